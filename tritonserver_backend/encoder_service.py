"""The encoder model's logic: per-session encoder state on the encoder engine, run once per token for every adapter.

Two kinds of call. A user turn (`encode_turn`: one session, the turn's tokens, and on a (re)start the history
before it) runs as prefill chunks; the decoder's per-step call (`encode_step`: every active session's newest token
in one batch) runs as one batched step. Each session has at most one turn in flight: from its user turn until the
decoder reports the turn done (or rolls it back), a second turn for it is refused, and the number of turns in
flight is the admission bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from build_engines.export.arena_pool import ArenaPool
from build_engines.export.rows import HANDOVER_KEYS, EncoderRow, absorb_encoder, encoder_inputs

from . import counters as k
from .counters import Counters
from .engines import StepEngine
from .errors import BadRequest, ServerBusy
from .session_store import SessionStore

DEFAULT_MAX_CONTEXT = 8192
DEFAULT_PREFILL_CHUNK = 256
MAX_DECODE_LANES = 2  # decode lanes the scheduler may alternate (scheduler.py); one stacked arena each here and in the decoder
Handover = dict[str, np.ndarray]  # rows (S, …) of one session, keyed as HANDOVER_KEYS (+ "positions")


@dataclass
class _InFlight:
    before: EncoderRow | None  # the state before the user turn (None: the turn started the session)


class EncoderService:
    def __init__(self, engine: StepEngine, budget_bytes: int = 2 << 30, max_context: int = DEFAULT_MAX_CONTEXT,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_turns: int = 0, counters: Counters | None = None) -> None:
        """`max_turns` bounds the turns in flight (active + queued at the decoder); 0 = no bound. `counters` count the
        tokens encoded (what shows that a continued conversation encodes only its new turn)."""
        self.engine, self.layout, self.cfg = engine, engine.layout, engine.cfg
        # opened now, not at the first turn: the token map is a pass over the vocabulary, and a checkpoint without its
        # Engram tables should fail at start-up
        self.engram = engine.engram
        self.max_context, self.prefill_chunk, self.max_turns = max_context, prefill_chunk, max_turns
        self.sessions: SessionStore[EncoderRow] = SessionStore(budget_bytes, lambda r: r.nbytes())
        self.arena = ArenaPool(MAX_DECODE_LANES)  # each decode lane's stacked state, kept between its steps
        self._in_flight: dict[str, _InFlight] = {}
        self.counters = counters or Counters()
        self._uncounted_steps = 0  # step tokens encoded since the last flush (see encode_step)

    def flush_counts(self) -> None:
        """Add the step tokens encoded since the last flush to the counters. Called at every turn's end, so the
        metric is exact whenever no turn is in flight and lags by the tokens of the turns in flight otherwise."""
        if self._uncounted_steps:
            self.counters.add(k.ENCODED_TOKENS, k.STEP, self._uncounted_steps)
            self._uncounted_steps = 0

    # ------------------------------------------------------------------ a user turn
    def encode_turn(self, session_id: str, token_ids: np.ndarray, prefix_ids: np.ndarray | None = None,
                    start: bool = False) -> tuple[np.ndarray, Handover]:
        """Encode a user turn -> (H19 pooled over `token_ids`, hand-over rows of everything encoded).

        A session starts when `start` is set, or is rebuilt when it is unknown and `prefix_ids` carries history (more
        than the lone <|bos|>); otherwise an unknown session is an error. Nothing is stored on error.
        """
        if not session_id:
            raise BadRequest("session_id must be a non-empty string")
        ids = check_ids(token_ids, self.cfg.vocab_size, "TOKEN_IDS")
        prefix = check_ids(prefix_ids, self.cfg.vocab_size, "PREFIX_IDS") if prefix_ids is not None else np.zeros(0, np.int64)
        if ids.size == 0:
            raise BadRequest("TOKEN_IDS is empty")
        if session_id in self._in_flight:
            raise BadRequest(f"session {session_id!r} is still answering its previous turn; wait for its final response")
        if self.max_turns and len(self._in_flight) >= self.max_turns:
            self.counters.add(k.TURNS_REFUSED, k.BUSY)
            raise ServerBusy(f"server busy: {len(self._in_flight)} turns in flight (limit {self.max_turns}); retry shortly")
        existed = self.sessions.contains(session_id)
        if start or (not existed and prefix.size > 1):
            row, ids_all = EncoderRow.empty(self.layout), np.concatenate([prefix, ids])
        else:
            row, ids_all = self.sessions.get(session_id).clone(), ids
        if row.position + ids_all.size > self.max_context:
            self.counters.add(k.TURNS_REFUSED, k.CONTEXT_LIMIT)
            raise BadRequest(f"session {session_id!r} would reach {row.position + ids_all.size} tokens, more than the "
                             f"{self.max_context}-token context limit")
        first = row.position
        parts = [self._prefill(row, ids_all[i:i + self.prefill_chunk]) for i in range(0, ids_all.size, self.prefill_chunk)]
        handover = {k: np.concatenate([p[k] for p in parts]) for k in HANDOVER_KEYS + ("h19",)}
        handover["positions"] = np.arange(first, row.position, dtype=np.int64)
        self._in_flight[session_id] = _InFlight(self.sessions.get(session_id) if existed else None)
        self.sessions.put(session_id, row)
        self.counters.add(k.ENCODED_TOKENS, k.TURN, int(ids_all.size))
        h19 = handover.pop("h19")[-ids.size:].mean(0)
        return h19.astype(np.float32), handover

    def _prefill(self, row: EncoderRow, ids: np.ndarray) -> Handover:
        out = self.engine.encoder(encoder_inputs(self.layout, [row], ids[None], engram=self.engram))
        absorb_encoder(self.layout, [row], out, ids.size, ids[None])
        return {k: out[k][0] for k in HANDOVER_KEYS + ("h19",)}

    # ------------------------------------------------------------------ the decoder's batched steps
    def encode_step(self, session_ids: list[str], tokens: np.ndarray, turn_done: bool = False) -> list[Handover]:
        """One batched step: `tokens` (B, S) are each session's next generated tokens (one row per session).

        `turn_done` marks the last call of those sessions' turns (the reply's last token and end-of-turn): their next
        user turn is then welcome. A session unknown here (evicted meanwhile) fails the whole call before any change.
        """
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[0] != len(session_ids) or tokens.dtype.kind not in "iu":
            raise BadRequest(f"step tokens must be an integer (sessions, steps) array, got {tokens.shape} for {len(session_ids)} sessions")
        if len(set(session_ids)) != len(session_ids):
            raise BadRequest("a session appears twice in one step")
        check_ids(tokens.reshape(-1), self.cfg.vocab_size, "STEP_TOKEN_IDS")
        rows = [self.sessions.get(s) for s in session_ids]
        over = [s for s, r in zip(session_ids, rows) if r.position + tokens.shape[1] > self.max_context]
        if over:
            raise BadRequest(f"sessions {over} would pass the {self.max_context}-token context limit")
        starts = [r.position for r in rows]
        tokens = tokens.astype(np.int64)
        out = self.engine.encoder(encoder_inputs(self.layout, rows, tokens, self.arena, self.engram))
        absorb_encoder(self.layout, rows, out, tokens.shape[1], tokens)
        # the count reaches the counters (a Triton metric: an IPC round trip) once per turn end, not once per step
        self._uncounted_steps += int(tokens.size)
        if turn_done:
            for s in session_ids:
                self._in_flight.pop(s, None)
            self.flush_counts()
        steps = tokens.shape[1]
        return [{**{k: out[k][b] for k in HANDOVER_KEYS}, "positions": np.arange(starts[b], starts[b] + steps, dtype=np.int64)}
                for b in range(len(session_ids))]

    # ------------------------------------------------------------------ turn bookkeeping
    def rollback(self, session_id: str) -> None:
        """Undo the user turn in flight (the decoder rejected it before absorbing anything)."""
        flight = self._in_flight.pop(session_id, None)
        if flight is None:
            return
        if flight.before is None:
            self.sessions.end(session_id)
        else:
            self.sessions.put(session_id, flight.before)

    def end(self, session_id: str) -> bool:
        self._in_flight.pop(session_id, None)
        return self.sessions.end(session_id)


def check_ids(ids: np.ndarray | None, vocab: int, name: str) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise BadRequest(f"{name} must be a 1-D integer tensor, got shape {a.shape} dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() >= vocab):
        raise BadRequest(f"{name} holds ids outside [0, {vocab})")
    return a.astype(np.int64)


