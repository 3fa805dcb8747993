"""In-flight batching: the token loops of every active turn advance together, one batched step per token.

Each iteration samples one token for every active turn and streams it, then runs ONE encoder call for all turns
still going (their new tokens, through the encoder port: a BLS call in Triton, a function call in-process) and ONE
batched decoder step. Turns that finish in the iteration send their last token and end-of-turn through the encoder
(one call per trailing length), are stored and answered; waiting turns join between iterations up to `max_active` (their
bounded replays run together as one batched step). A batch never changes a row's result: every turn gets the tokens it
would get alone.

Triton-free: what to do with a token or a finished turn is the `emit` callback, which returns False when the client
is gone (the turn then ends as "cancelled", its partial reply kept in the history like a reply cut by max_tokens).
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from tritonserver_backend.core import counters as k
from tritonserver_backend.core.decoder_service import FINISH_CANCELLED, FINISH_LENGTH, DecoderService, Turn
from tritonserver_backend.core.drafting import DRAFT_BATCH, Drafter
from tritonserver_backend.core.handover import MAX_DECODE_LANES, Handover
from tritonserver_backend.errors import ServingError, TurnCancelled, TurnFailed, TurnRejected
from tritonserver_backend.sampling.sampler import SamplingParams

LOG = logging.getLogger("mol2")


class EncoderPort(Protocol):
    """The encoder as the scheduler calls it. A port whose encoder hands out turn ids (EncodedTurn.turn_id, carried
    in TurnStart.turn_id) also takes `turn_ids` on `step`, `turn_id` on `rollback`, and `claim`; the scheduler sends
    them only for turns that have an id, so a port without leases (turn id 0) is called as before."""

    def step(self, session_ids: list[str], tokens: np.ndarray, turn_done: bool, keep: np.ndarray | None = None,
             draft: bool = False, **turn_ids: object) -> list[Handover]: ...

    def rollback(self, session_id: str, *turn_id: int) -> bool | None: ...

    def drop(self, session_id: str) -> None: ...


def _claim(encoder: EncoderPort, session_id: str, turn_id: int) -> None:
    claim = getattr(encoder, "claim", None)
    if claim is not None:
        claim(session_id, turn_id)


@dataclass
class TurnStart:
    """What the decoder needs to start a turn (read from the request by the caller)."""

    session_id: str
    handover: Handover
    adapter_hash: int
    params: SamplingParams
    end_session: bool = False
    context: object = None
    fork_from: str = ""  # contract.FORK_FROM: the session this new one starts as a copy of
    # a fork that ends its source on the decoder once copied: the last of n choices, whose source (the prompt's
    # prefill-only session) no turn needs again (the caller ends the source's encoder side itself)
    end_source: bool = False
    turn_id: int = 0  # the encoder's lease of this turn (EncodedTurn.turn_id; 0: an encoder without leases)


@dataclass
class StepTokens:
    """One encoder call of the token loop: tokens (B, S) (the last token, then any drafts), each turn's kept length of
    its previous speculative step (-1: none), and the drafts (None: a plain step)."""

    tokens: np.ndarray
    keep: np.ndarray
    drafts: list[list[int]] | None = None

    def row(self, b: int) -> "StepTokens":
        return StepTokens(self.tokens[b:b + 1], self.keep[b:b + 1],
                          None if self.drafts is None else self.drafts[b:b + 1])


REPLAY_BATCH = 8  # starting turns per batched replay (up to 8 x 128 rows through the decoder in one call)
DEFAULT_REPLAY_BUDGET = 512  # replayed positions per iteration while other turns decode: about four full windows
Emit = Callable[[Turn, int, str], bool]  # (turn, token or -1, finish reason or "") -> client still there
Fail = Callable[[TurnStart | Turn, BaseException], None]


class TurnScheduler:
    def __init__(self, decoder: DecoderService, encoder: EncoderPort, emit: Emit, fail: Fail, max_active: int = 32,
                 lanes: int = 1, drafter: Drafter | None = None, draft_batch: int = DRAFT_BATCH,
                 replay_budget: int = 0) -> None:
        """`lanes`: the active turns are split into this many lanes whose steps alternate, so that one lane's encoder
        step (in the encoder's process) runs while the previous lane's decoder step runs on the engine thread; 1 = every
        active turn in one batch, encoder and decoder strictly one after the other (the default: on 2 cores two lanes
        measured no faster, docs/load.md). A lane changes no row's result.

        `drafter` (speculative decoding; None: off): each step feeds a turn its last token and the drafter's guesses,
        and the decoder keeps what the target agrees with. Only while a lane has at most `draft_batch` turns going:
        a loaded batch is already compute-bound, and verifying drafts there costs more than it saves.

        `replay_budget` (positions; 0: no bound): while turns are decoding, the starting turns that join in one
        iteration replay about this many positions in all (at least one turn joins), so that a wave of new turns
        delays the streams already going by about one budget's compute per token, not by every replay at once (the
        encoder bounds a long prompt's prefill the same way, prefill_queue.py). With nothing decoding, every waiting
        turn joins at once."""
        if replay_budget < 0:
            raise ValueError(f"the replay budget must be 0 (no bound) or positive, got {replay_budget}")
        self.replay_budget = replay_budget
        self.decoder, self.encoder, self.emit, self.fail = decoder, encoder, emit, fail
        self.drafter, self.draft_batch = drafter, draft_batch
        self.max_active = max_active
        self.waiting: deque[TurnStart] = deque()
        if not 1 <= lanes <= MAX_DECODE_LANES:
            raise ValueError(f"decode lanes must lie in [1, {MAX_DECODE_LANES}], got {lanes}")
        self.lanes: list[list[Turn]] = [[] for _ in range(lanes)]
        self._pending: list[tuple[list[Turn], Future | BaseException, StepTokens] | None] = [None] * lanes
        self._next_lane = 0
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="mol2-engine")  # every engine call, never pb_utils
        # the per-step encoder call, so that responses stream while it runs; one call at a time, and it is the only
        # port call that does not run on the scheduler's own thread (see `_advance`)
        self._encoder_calls = ThreadPoolExecutor(1, thread_name_prefix="mol2-encoder-call")
        self._encoding: Future | None = None  # the encoder call in flight, until its decoder step starts

    @property
    def active(self) -> list[Turn]:
        return [turn for lane in self.lanes for turn in lane]

    def submit(self, request: TurnStart) -> None:
        """Queue a turn, first claiming it from the encoder (turn_lease.py): from here on its lease does not expire
        however long it waits for a row, and a turn whose lease already ended is refused here, before it runs."""
        if request.turn_id:
            _claim(self.encoder, request.session_id, request.turn_id)
        self.decoder.count(k.READ, request.adapter_hash)
        self.waiting.append(request)

    def cancel(self, session_id: str) -> str:
        """Stop the session's turn: a waiting one is dropped (its encoding rolled back), an active one ends at the next
        iteration as "cancelled" with its partial reply kept in the history. Returns what happened."""
        for request in list(self.waiting):
            if request.session_id == session_id:
                self.waiting.remove(request)
                self._refuse(request, TurnCancelled(f"the turn of session {session_id!r} was cancelled before it "
                                                    "started"))
                return "cancelled before it started"
        for turn in self.active:
            if turn.session_id == session_id and not turn.finish:
                turn.finish = FINISH_CANCELLED
                return "cancelled; the partial reply stays in the history"
        return "no turn in flight"

    def end_idle(self, session_id: str) -> str:
        """session_control's "end": drop an idle session on both sides without a turn (a completions prompt whose
        forks have all started). A session with a turn waiting or in flight is left alone."""
        if (any(r.session_id == session_id for r in self.waiting)
                or any(t.session_id == session_id for t in self.active)):
            return "not ended: a turn of the session is in flight"
        self.decoder.end(session_id)
        self._quietly(self.encoder.drop, session_id)
        return "ended"

    def close(self) -> None:
        self._encoder_calls.shutdown(wait=True)
        self._compute.shutdown(wait=True)

    @property
    def idle(self) -> bool:
        return not self.waiting and not any(self.lanes) and all(p is None for p in self._pending)

    def iterate(self) -> None:
        """One iteration (`_iterate`). Should it fail unexpectedly (a bug, an engine failure outside the guarded calls),
        every turn in flight is answered with the error and rolled back, and the scheduler starts afresh: the caller's
        loop goes on, and no client waits forever for a turn nobody advances."""
        try:
            self._iterate()
        except Exception as exc:  # noqa: BLE001
            LOG.exception("decoder: a scheduler iteration failed; every turn in flight is answered and rolled back")
            self._fail_everything(exc)

    @staticmethod
    def _failure(exc: BaseException) -> TurnFailed:
        return TurnFailed(f"the decoder failed while serving this turn ({type(exc).__name__}: {exc}); the turn was "
                          "rolled back and the session keeps its earlier turns: resend it")

    def _fail_everything(self, exc: BaseException) -> None:
        error = self._failure(exc)
        if self._encoding is not None:  # an encoder call in flight finishes before any rollback is sent
            self._encoding.exception()
            self._encoding = None
        for lane in range(len(self.lanes)):  # let steps in flight finish: they write into these turns' rows
            pending, self._pending[lane] = self._pending[lane], None
            if pending is not None and isinstance(pending[1], Future):
                pending[1].exception()
        turns = self.active
        self.lanes = [[] for _ in self.lanes]
        for turn in turns:
            if turn.finish != "error":
                self._guarded(self._abort, turn, error)
        while self.waiting:
            self._guarded(self._refuse, self.waiting.popleft(), error)

    @staticmethod
    def _guarded(call: Callable[..., None], *args: object) -> None:
        try:
            call(*args)
        except Exception:  # noqa: BLE001 - failing one turn must not stop failing the others
            LOG.exception("decoder: answering a failed turn failed")

    def _iterate(self) -> None:
        """One token for every turn of the next lane (waiting turns join first, when rows are free).

        Joining needs the engine to itself (a replay may restack the adapter bank), so every lane's step in flight is
        settled first; that happens once per starting turn, not once per token.
        """
        if self.waiting and len(self.active) < self.max_active:
            self._settle_all()
            self._admit()
        lane = self._next_lane
        self._next_lane = (lane + 1) % len(self.lanes)
        self._advance(lane)

    def _advance(self, lane: int) -> None:
        """Settle the lane's previous decoder step, sample a token for each of its turns, run its next step (the encoder
        call, then the decoder step on the compute thread), stream the tokens and finish the turns that ended.

        The streamed responses overlap both halves of the step: each send is an IPC round trip that needs nothing
        from the step (at 16 sessions the sends cost about as much as the decoder step itself, docs/load.md), so they
        go out while the encoder call runs on its own thread, and whatever is left once it returns goes out while the
        decoder step runs. Sending only during the decoder step left the second core idle through the encoder call
        and stretched the decoder step with the sends' CPU. The next lane's encoder call overlaps this lane's decoder
        step."""
        self._settle_lane(lane)
        turns = self.lanes[lane]
        going: list[Turn] = []
        chosen: list[tuple[Turn, int]] = []
        self.decoder.constrain([t for t in turns if not t.finish])  # the grammar rows' bitmask, one fill for the batch
        for turn in turns:
            if turn.finish == "error":
                continue
            if turn.block is not None:  # a speculative step: its accepted tokens (none for a turn that ended meanwhile)
                chosen.extend((turn, token) for token in self.decoder.choose_block(turn))
            else:
                token = None if turn.finish else self.decoder.choose(turn)
                if token is not None:
                    chosen.append((turn, token))
            if not turn.finish:
                going.append(turn)
        unsent = deque(chosen)
        if going:
            step = self._next_step(going)
            encoding = self._encode(going, step)
            while unsent and not encoding.done():
                self._stream(*unsent.popleft())
            self._pending[lane] = (going, self._start_decoder(going, step), step)
        while unsent:
            self._stream(*unsent.popleft())
        for turn in [t for t in turns if t.finish and t.finish != "error" and t not in going]:
            self._end(turn)
        self.lanes[lane] = [t for t in turns if t.finish != "error" and (t in going or not t.finish)]

    def _stream(self, turn: Turn, token: int) -> None:
        if not self.emit(turn, token, ""):
            turn.finish = turn.finish or FINISH_CANCELLED  # seen at the next iteration; its partial reply is kept

    def _settle_lane(self, lane: int) -> None:
        pending, self._pending[lane] = self._pending[lane], None
        if pending is not None:
            self._settle(*pending)

    def _settle_all(self) -> None:
        for lane in range(len(self.lanes)):
            self._settle_lane(lane)

    # ------------------------------------------------------------------ joining
    def _admit(self) -> None:
        """Start waiting turns while rows are free: check and absorb each, then batched replays; each joins the lane
        with the fewest turns, and lanes are evened out (a moved turn restacks both lanes' arenas once).

        Runs only while no decoder step is in flight (`iterate` settles every lane first): a new adapter version
        restacks the engine's adapter bank here."""
        starting: list[Turn] = []
        budget = self.replay_budget if self.replay_budget and self.active else None
        replayed = 0
        while (self.waiting and len(self.active) + len(starting) < self.max_active
               and (budget is None or replayed < budget)):
            request = self.waiting.popleft()
            try:
                turn = self.decoder.prepare(request.session_id, request.handover, request.adapter_hash, request.params,
                                            request.fork_from)
            except TurnRejected as exc:  # nothing was absorbed: undo the turn's encoding so the session loses nothing
                self._refuse(request, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug while checking one turn: it is answered, the others go on
                LOG.exception("decoder: checking the turn of %s failed", request.session_id)
                self._refuse(request, self._failure(exc))
                continue
            turn.end_session, turn.context, turn.turn_id = request.end_session, request.context, request.turn_id
            if request.end_source and request.fork_from:  # copied by `prepare`: the source is not read again
                self.decoder.end(request.fork_from)
            if turn.limit == 0:  # a prefill-only turn (max_tokens 0): nothing to generate, so no replay; stored at once
                turn.finish = FINISH_LENGTH
                self._end(turn)
                continue
            starting.append(turn)
            replayed += turn.row.replay_count
        if not starting:
            return
        starting.sort(key=lambda t: t.row.replay_count)  # similar lengths share a replay batch
        for i in range(0, len(starting), REPLAY_BATCH):
            group = starting[i:i + REPLAY_BATCH]
            try:
                self._compute.submit(self.decoder.replay, group).result()
            except Exception as exc:  # noqa: BLE001 - an engine failure fails these turns only
                LOG.exception("decoder: the replay of %d starting turns failed", len(group))
                for turn in group:
                    self.decoder.count(k.REJECTED, 0 if turn.adapter is None else turn.adapter.hash)
                    self._abort(turn, exc)
                continue
            self.decoder.count_applied(group)
            for turn in group:
                min(self.lanes, key=len).append(turn)
        self._balance()

    def _balance(self) -> None:
        while True:
            longest, shortest = max(self.lanes, key=len), min(self.lanes, key=len)
            if len(longest) - len(shortest) <= 1:
                return
            shortest.append(longest.pop())

    # ------------------------------------------------------------------ stepping
    def _next_step(self, turns: list[Turn]) -> "StepTokens":
        """What each going turn feeds next: its last token, then (speculative decoding) its drafts, as many for every
        turn (a shorter guess is padded with its own last draft, a turn that does not draft verifies padding it never
        keeps), and the kept length of each turn's previous speculative step for the encoder."""
        keep = np.asarray([t.keep for t in turns], np.int64)
        for turn in turns:
            turn.keep = -1
        last = [t.generated[-1] for t in turns]
        drafts = self._drafts(turns)
        if drafts is None:
            return StepTokens(np.asarray(last, np.int64)[:, None], keep)
        return StepTokens(np.asarray([[t, *d] for t, d in zip(last, drafts)], np.int64), keep, drafts)

    def _drafts(self, turns: list[Turn]) -> list[list[int]] | None:
        """Each turn's drafts for this step, or None for a plain step: no drafter, a loaded lane, no guess at all, or
        a turn whose block would not fit its context."""
        if self.drafter is None or len(turns) > self.draft_batch:
            return None
        counts = [t.limit - len(t.generated) - 1 if t.drafts_allowed else 0 for t in turns]
        if not any(c > 0 for c in counts):
            return None
        guesses = self._compute.submit(self.drafter.propose, turns, counts).result()  # a drafter may run the engines
        width = max(len(g) for g in guesses)
        if width == 0 or any(t.row.position + 1 + width > self.decoder.max_context - 1 for t in turns):
            return None
        return [g + [g[-1] if g else t.generated[-1]] * (width - len(g)) for t, g in zip(turns, guesses)]

    def _step(self, turns: list[Turn], step: "StepTokens") -> tuple[Future | BaseException, "StepTokens"]:
        """The encoder call for these turns' tokens, then the decoder step started on the compute thread (or the
        encoder's error: it refuses a batch as a whole, before changing anything)."""
        self._encode(turns, step)
        return self._start_decoder(turns, step), step

    def _encode(self, turns: list[Turn], step: "StepTokens") -> Future:
        """Start the encoder call for these turns' tokens on its thread (one at a time: the previous one was waited
        for)."""
        self._encoding = self._encoder_calls.submit(self._encoder_step, list(turns), step, False)
        return self._encoding

    def _encoder_step(self, turns: list[Turn], step: "StepTokens", turn_done: bool) -> list[Handover]:
        session_ids = [t.session_id for t in turns]
        named = {"turn_ids": np.asarray([t.turn_id for t in turns], np.int64)} if all(t.turn_id for t in turns) else {}
        if step.drafts is None and (step.keep < 0).all():  # a plain step: the call every encoder port takes
            return self.encoder.step(session_ids, step.tokens, turn_done, **named)
        return self.encoder.step(session_ids, step.tokens, turn_done, step.keep, step.drafts is not None, **named)

    def _start_decoder(self, turns: list[Turn], step: "StepTokens") -> Future | BaseException:
        """Wait for the encoder call in flight (`_encode`), then start the decoder step on the compute thread; the
        encoder's error instead, if it refused the batch."""
        assert self._encoding is not None
        try:
            handovers = self._encoding.result()
        except Exception as exc:  # noqa: BLE001
            return exc
        finally:
            self._encoding = None
        return self._compute.submit(self.decoder.advance, turns, handovers, step.drafts)

    def _settle(self, turns: list[Turn], advancing: Future | BaseException, step: "StepTokens") -> None:
        """Wait for the decoder step. An encoder refusal (a session evicted meanwhile) is retried turn by turn, so only
        the failing turn ends; an engine failure ends the turns of that batch."""
        if isinstance(advancing, Future):
            try:
                advancing.result()
            except Exception as exc:  # noqa: BLE001
                for turn in turns:
                    self._abort(turn, exc)
                return
            self.decoder.count_step(k.DECODE, len(turns))
            return
        if len(turns) == 1:
            self._abort(turns[0], advancing)
            return
        for i, turn in enumerate(turns):
            self._settle([turn], *self._step([turn], step.row(i)))

    def _end(self, turn: Turn) -> None:
        """Trailing tokens through the encoder, store the decoder's side, commit the turn on the encoder (its journal
        record), send the final response. One commit per turn: until the commit, a failure rolls both sides back to
        the previous turn; a commit whose answer is lost is settled by the rollback's answer (the encoder says
        whether the turn was still open), so both sides end at the same turn either way."""
        try:
            eot = self.decoder.tokenizer.end_of_turn_id
            # a raw session has no end-of-turn, nor has a prefill-only turn (it stops at the assistant prompt, to be
            # forked)
            tail = turn.trailing(eot)[:-1] if turn.params.raw or turn.limit == 0 else turn.trailing(eot)
            step = StepTokens(np.asarray([tail], np.int64).reshape(1, len(tail)), np.asarray([turn.keep], np.int64))
            turn.keep = -1
            trailing = self._encoder_step([turn], step, False)[0]
            previous = self.decoder.finish(turn, trailing)
        except Exception as exc:  # noqa: BLE001
            self._abort(turn, exc)
            return
        try:
            self._encoder_step([turn], StepTokens(np.zeros((1, 0), np.int64), np.asarray([-1], np.int64)), True)
        except Exception as exc:  # noqa: BLE001
            if self._rolled_back(turn):
                self.decoder.restore(turn.session_id, previous)
            self._fail_turn(turn, exc)
            return
        if turn.end_session:  # gone before the client hears the end: its next request finds it ended, not half-ended
            self.decoder.end(turn.session_id)
            self._quietly(self.encoder.drop, turn.session_id)
        self.emit(turn, -1, turn.finish)

    def _refuse(self, request: TurnStart, exc: BaseException) -> None:
        """A turn that never started (rejected, cancelled while waiting, or failed with the scheduler): counted as a
        rejected routing decision, its encoding rolled back so that the session loses nothing, its error answered."""
        self.decoder.count(k.REJECTED, request.adapter_hash)
        self._rollback(request.session_id, request.turn_id)
        self.fail(request, exc)

    def _abort(self, turn: Turn, exc: BaseException) -> None:
        """A turn whose step failed (session evicted meanwhile, engine error): its error goes to its client; the
        session keeps what was stored before this turn."""
        self.decoder.release(turn)
        self._rollback(turn.session_id, turn.turn_id)
        self._fail_turn(turn, exc)

    def _fail_turn(self, turn: Turn, exc: BaseException) -> None:
        if not isinstance(exc, ServingError):
            LOG.error("decoder: turn of %s failed: %r", turn.session_id, exc)
        turn.finish = turn.finish or "error"
        self.fail(turn, exc)

    def _rollback(self, session_id: str, turn_id: int) -> bool | None:
        """Roll the turn back on the encoder (only that turn: a rollback naming a turn no longer in flight changes
        nothing) -> whether the encoder still had it open (None: the port does not say, or the call failed)."""
        try:
            return self.encoder.rollback(session_id, turn_id) if turn_id else self.encoder.rollback(session_id)
        except Exception:  # noqa: BLE001 - best effort; the turn's own error is what the client sees
            LOG.exception("decoder: rolling back the turn of %s failed", session_id)
            return None

    def _rolled_back(self, turn: Turn) -> bool:
        """After a failed commit: roll the turn back on the encoder -> True when the decoder must go back too (the
        encoder had not committed it, or cannot say), False when the encoder had committed it (the commit's answer
        was lost): the decoder's side then stays, and both sides hold the turn."""
        return self._rollback(turn.session_id, turn.turn_id) is not False

    @staticmethod
    def _quietly(call: Callable[[str], None], session_id: str) -> None:
        try:
            call(session_id)
        except Exception:  # noqa: BLE001 - best effort; the turn's own error is what the client sees
            LOG.exception("decoder: clean-up call for %s failed", session_id)
