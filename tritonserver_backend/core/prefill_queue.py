"""The encoder's user turns waiting for their prefill, advanced one chunk at a time between the other calls.

A user turn's prefill is the one long call an encoder serves: thousands of tokens against a decoder's per-token step
call of one token per active session. Run whole on arrival, one 24,000-character prompt stopped every other
session's stream for its entire prefill (2.6 s, 208x the inter-token gap, issue 49). Here a turn is checked and taken
in flight on arrival (`EncoderService.begin_turn`), then each iteration of the encoder's loop prefills one piece of
`tokens` tokens (the token budget of one iteration, `prefill_tokens_per_step`) of one waiting turn, round robin, and
whatever arrived meanwhile (the decoder's step calls above all) is served before the next piece. A step call
therefore waits behind at most one piece, whatever the prompt's length, and a short prompt behind a long one waits
for one piece per turn ahead of it, not for the whole long prefill.

How a prefill is cut changes no bit of its state or rows (`EncoderService.advance_turn`), so none of this changes a
reply.
Triton-free: answering a finished (or failed) turn is the `answer` callback.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from tritonserver_backend.core.encoder_service import DEFAULT_PREFILL_STEP, EncodedTurn, EncoderService, TurnPrefill

Answer = Callable[[Any, EncodedTurn | BaseException], None]  # (the caller's handle of the turn, its outcome)


class PrefillQueue:
    def __init__(self, service: EncoderService, answer: Answer, tokens: int = DEFAULT_PREFILL_STEP) -> None:
        if tokens < 1:
            raise ValueError(f"a prefill piece must hold at least one token, got {tokens}")
        self.service, self.answer, self.tokens = service, answer, tokens
        self._waiting: deque[tuple[Any, TurnPrefill]] = deque()

    @property
    def idle(self) -> bool:
        return not self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, handle: Any, turn: TurnPrefill) -> None:
        """Queue a turn `begin_turn` took in flight; `handle` comes back with its outcome."""
        self._waiting.append((handle, turn))

    def iterate(self) -> None:
        """Prefill one piece of the turn at the head, then move it to the back, or hand it over once it is done. A
        failure (the session was ended meanwhile, an engine error) fails that turn alone and leaves its session as
        it was."""
        if not self._waiting:
            return
        handle, turn = self._waiting.popleft()
        try:
            if not self.service.advance_turn(turn, self.tokens):
                self._waiting.append((handle, turn))
                return
            outcome: EncodedTurn | BaseException = self.service.finish_turn(turn)
        except Exception as exc:  # noqa: BLE001 - one turn's failure is its own answer
            self.service.abandon_turn(turn)
            outcome = exc
        self.answer(handle, outcome)

    def fail_all(self, exc: BaseException) -> None:
        """Answer every waiting turn with `exc` (the server is shutting down) and let their sessions be."""
        while self._waiting:
            handle, turn = self._waiting.popleft()
            self.service.abandon_turn(turn)
            self.answer(handle, exc)
