"""In-flight batching: the token loops of every active turn advance together, one batched step per token.

Each iteration samples one token for every active turn and streams it, then runs ONE encoder call for all turns
still going (their new tokens, through the encoder port: a BLS call in Triton, a function call in-process) and ONE
batched decoder step. Turns that finish in the iteration send their last token and end-of-turn through the encoder
(one call per trailing length), are stored and answered; waiting turns join between iterations (their bounded replay
runs as their own step) up to `max_active`. A batch never changes a row's result: every turn gets the tokens it
would get alone.

Triton-free: what to do with a token or a finished turn is the `emit` callback, which returns False when the client
is gone (the turn then ends as "cancelled", its partial reply kept in the history like a reply cut by max_tokens).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from .decoder_service import FINISH_CANCELLED, DecoderService, Turn
from .encoder_service import Handover
from .errors import ServingError, TurnRejected
from .sampling import SamplingParams

LOG = logging.getLogger("mol2")


class EncoderPort(Protocol):
    def step(self, session_ids: list[str], tokens: np.ndarray, turn_done: bool) -> list[Handover]: ...

    def rollback(self, session_id: str) -> None: ...

    def drop(self, session_id: str) -> None: ...


@dataclass
class TurnRequest:
    """What the decoder needs to start a turn (read from the request by the caller)."""

    session_id: str
    handover: Handover
    adapter_hash: int
    params: SamplingParams
    end_session: bool = False
    context: object = None


Emit = Callable[[Turn, int, str], bool]  # (turn, token or -1, finish reason or "") -> client still there
Fail = Callable[[TurnRequest | Turn, BaseException], None]


class TurnScheduler:
    def __init__(self, decoder: DecoderService, encoder: EncoderPort, emit: Emit, fail: Fail, max_active: int = 32) -> None:
        self.decoder, self.encoder, self.emit, self.fail = decoder, encoder, emit, fail
        self.max_active = max_active
        self.waiting: deque[TurnRequest] = deque()
        self.active: list[Turn] = []

    def submit(self, request: TurnRequest) -> None:
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def iterate(self) -> None:
        """Admit waiting turns, then advance every active turn by one token."""
        self._admit()
        if not self.active:
            return
        going, ending = [], []
        tokens: list[int] = []
        for turn in self.active:
            token = self.decoder.choose(turn)
            if token is not None and not self.emit(turn, token, ""):
                turn.finish = FINISH_CANCELLED
            (ending if turn.finish else going).append(turn)
            if not turn.finish:
                tokens.append(token)  # type: ignore[arg-type]
        if going:
            self._step(going, np.asarray(tokens, np.int64)[:, None])
        for turn in ending:
            self._end(turn)
        self.active = [t for t in self.active if not t.finish]

    # ------------------------------------------------------------------ joining
    def _admit(self) -> None:
        while self.waiting and len(self.active) < self.max_active:
            request = self.waiting.popleft()
            try:
                turn = self.decoder.begin(request.session_id, request.handover, request.adapter_hash, request.params)
            except TurnRejected as exc:  # nothing was absorbed: undo the turn's encoding so the session loses nothing
                self._quietly(self.encoder.rollback, request.session_id)
                self.fail(request, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - an engine failure on one turn fails that turn only
                LOG.exception("decoder: starting a turn of %s failed", request.session_id)
                self._quietly(self.encoder.rollback, request.session_id)
                self.fail(request, exc)
                continue
            turn.end_session, turn.context = request.end_session, request.context
            self.active.append(turn)

    # ------------------------------------------------------------------ stepping
    def _step(self, turns: list[Turn], tokens: np.ndarray) -> None:
        try:
            handovers = self.encoder.step([t.session_id for t in turns], tokens, False)
            self.decoder.advance(turns, handovers)
        except Exception as exc:  # noqa: BLE001 - find the turn that fails and let the others go on
            if len(turns) == 1:
                self._abort(turns[0], exc)
                return
            for i, turn in enumerate(turns):
                self._step([turn], tokens[i:i + 1])

    def _end(self, turn: Turn) -> None:
        """Trailing tokens through the encoder (which marks the turn done), store the session, send the final response."""
        try:
            eot = self.decoder.tokenizer.end_of_turn_id
            trailing = self.encoder.step([turn.session_id], np.asarray([turn.trailing(eot)], np.int64), True)[0]
            self.decoder.finish(turn, trailing)
        except Exception as exc:  # noqa: BLE001
            self._abort(turn, exc)
            return
        self.emit(turn, -1, turn.finish)
        if turn.end_session:
            self.decoder.end(turn.session_id)
            self._quietly(self.encoder.drop, turn.session_id)

    def _abort(self, turn: Turn, exc: BaseException) -> None:
        """A turn whose step failed (session evicted meanwhile, engine error): its error goes to its client; the
        session keeps what was stored before this turn."""
        if not isinstance(exc, ServingError):
            LOG.error("decoder: turn of %s failed: %r", turn.session_id, exc)
        turn.finish = turn.finish or "error"
        self.decoder.release(turn)
        self._quietly(self.encoder.rollback, turn.session_id)
        self.fail(turn, exc)

    @staticmethod
    def _quietly(call: Callable[[str], None], session_id: str) -> None:
        try:
            call(session_id)
        except Exception:  # noqa: BLE001 - best effort; the turn's own error is what the client sees
            LOG.exception("decoder: clean-up call for %s failed", session_id)
