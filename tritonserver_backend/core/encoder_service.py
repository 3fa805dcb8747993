"""The encoder model's logic: per-session encoder state on the encoder engine, run once per token for every adapter.

Two kinds of call. A user turn (one session, the turn's tokens, and on a (re)start the history before it) is checked
and taken in flight (`begin_turn`), prefilled piece by piece (`advance_turn`, which a server interleaves with the
other calls: prefill_queue.py) and handed over (`finish_turn`); `encode_turn` does all three at once. The decoder's
per-step call (`encode_step`: every active session's newest token in one batch) runs as one batched step. Each
session has at most one turn in flight: from its user turn until the decoder commits the turn (or rolls it back), a
second turn for it is refused, and the number of turns in flight is the admission bound.

Each turn in flight is one `TurnLease` (turn_lease.py): its slot, its pins on the prefix cache, the state a rollback
restores, its unjournaled tokens and its waiting speculative step. A handed-over turn whose decoder does not claim it
within the lease (`lease_s`) is rolled back and its slot freed, so a client that calls the encoder alone cannot hold
slots; every way a turn ends (committed, rolled back, expired, abandoned, its session evicted or ended) gives all of it
back in one place (`_release`).

One commit per turn: the decoder feeds a turn's last tokens (`encode_step`), stores its own side, and only then
commits the turn here (`encode_step` with `turn_done` and no tokens): a failure in between is rolled back on both sides
(`rollback` with the turn's id), so encoder and decoder never disagree on a session's length.

A starting session takes the longest cached prefix of its tokens from the prefix cache (prefix_cache.py), and between
its turns rests on it, holding only its own state (resting_rows.py).

With a journal (session_journal.py), every completed turn's tokens are written to disk before the decoder's last step
call returns, and a session the journal holds but memory does not (the server restarted, a model process died) is
rebuilt on its next turn: its history is prefilled (from the prefix cache where it can) and the turn goes on, under
the session token it always had.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field

import numpy as np

from ced.steps.arena_pool import ArenaPool
from ced.steps.rows import HANDOVER_KEYS, EncoderRow, absorb_encoder, encoder_inputs
from tritonserver_backend.auth.session_auth import SessionRefused, SessionTokens, refusal, token_digest
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.core.handover import MAX_DECODE_LANES, Handover
from tritonserver_backend.core.prefix_cache import PrefixCache, PrefixEntry, check_salt
from tritonserver_backend.core.resting_rows import RestingRow, rest, wake
from tritonserver_backend.core.session_journal import SessionJournal
from tritonserver_backend.core.session_journal import check_session_id as journal_session_id
from tritonserver_backend.core.session_store import SessionStore
from tritonserver_backend.core.turn_lease import (
    ABANDONED,
    CLAIMED,
    DONE,
    ENDED,
    EVICTED,
    EXPIRED,
    HANDED_OVER,
    ROLLED_BACK,
    DraftBlock,
    LeaseTable,
    TurnIds,
    TurnLease,
)
from tritonserver_backend.engines import StepEngine
from tritonserver_backend.errors import BadRequest, ServerBusy, TurnNotDurable, UnknownSession

LOG = logging.getLogger("mol2")

DEFAULT_MAX_CONTEXT = 8192
DEFAULT_PREFILL_CHUNK = 256
# tokens a waiting prefill advances by between two of the decoder's step calls (prefill_queue.py): the most a step
# waits for is one such piece (about 30 ms at 7 K tokens of context on the 2-core machine, docs/load.md)
DEFAULT_PREFILL_STEP = 64


def check_session_id(session_id: object) -> str:
    """A request's session id: a non-empty string within the journal's bound (`session_journal.check_session_id`,
    the one place that bound is checked), as a client's BadRequest."""
    if not isinstance(session_id, str) or not session_id:
        raise BadRequest("session_id must be a non-empty string")
    try:
        journal_session_id(session_id)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return session_id


@dataclass(frozen=True)
class EncodedTurn:
    """What a user turn's encoding hands on: H19 pooled over the turn, the hand-over rows, and the session token
    issued when this turn (re)started the session ("" on a continuing turn, or with session tokens off)."""

    h19: np.ndarray
    handover: Handover
    issued_token: str = ""
    turn_id: int = 0  # the turn's lease (turn_lease.py): the decoder names it when it claims, steps, commits


@dataclass
class TurnPrefill:
    """A user turn between `begin_turn` and `finish_turn`: its own copy of the session's state, the tokens to
    prefill and how many are done (a prefix cache hit counts as done), and the hand-over rows so far."""

    session_id: str
    lease: TurnLease  # its hold on the encoder (a session ended meanwhile no longer holds it)
    row: EncoderRow
    ids: np.ndarray  # every token to encode: the history and the turn on a (re)start, else the turn
    new: int  # the turn's own tokens (the last `new` of `ids`): what H19 is pooled over
    first: int  # the position of ids[0]
    existed: bool  # the session was live when the turn began
    restart: bool
    fork_h19: np.ndarray | None = None  # a fork's source's last H19 (what a fork without new tokens routes on)
    done: int = 0
    cached: int = 0  # tokens taken from the prefix cache
    parts: list[Handover] = field(default_factory=list)
    salt: str = ""
    chain: list[bytes] = field(default_factory=list)  # the prefix cache's block keys (empty: no cache for it)
    base: PrefixEntry | None = None  # the cached prefix the session will rest on between turns (resting_rows.py)
    resumed_digest: str | None = None  # rebuilt from the journal: the token digest the session keeps
    resumed: bool = False
    journal_prefix: np.ndarray | None = None  # a fork's source's history (what the fork's journal starts with)
    journal_skip: bool = False  # the turn's session cannot be journaled whole (a fork of an unjournaled source)


class EncoderService:
    def __init__(self, engine: StepEngine, budget_bytes: int = 2 << 30, max_context: int = DEFAULT_MAX_CONTEXT,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_turns: int = 0, counters: Counters | None = None,
                 session_auth: bool = True, prefix_cache_bytes: int = 0,
                 journal: SessionJournal | None = None, lease_s: float = 0.0) -> None:
        """`max_turns` bounds the turns in flight (active + queued at the decoder); 0 = no bound. `counters` count the
        tokens encoded (what shows that a continued conversation encodes only its new turn). `session_auth`: a
        session's later turns need the token issued when it started (session_auth.py); off only for a trusted
        single-tenant deployment. `prefix_cache_bytes`: the prefix cache's budget (prefix_cache.py; 0: off), beside
        the session budget; its block is the prefill chunk. `journal`: where completed turns are written and lost
        sessions are resumed from (None: sessions live in memory only). `lease_s`: how long a handed-over turn waits
        for its decoder's claim before it is rolled back and its slot freed (turn_lease.py; 0: never, for a caller
        that runs both halves of every turn itself and never claims)."""
        self.engine, self.layout, self.cfg = engine, engine.layout, engine.cfg
        # opened now, not at the first turn: the token map is a pass over the vocabulary, and a checkpoint without its
        # Engram tables should fail at start-up
        self.engram = engine.engram
        self.max_context, self.prefill_chunk, self.max_turns = max_context, prefill_chunk, max_turns
        # a session's state: whole while a turn of it is in flight, resting on its cached prefix between turns
        self.sessions: SessionStore[EncoderRow | RestingRow] = SessionStore(budget_bytes, lambda r: r.nbytes(),
                                                                            on_drop=self._dropped)
        self._bases: dict[str, PrefixEntry] = {}  # session -> the cached prefix it rests on (pinned in the cache)
        self.arena = ArenaPool(MAX_DECODE_LANES)  # each decode lane's stacked state, kept between its steps
        self.leases = LeaseTable(max_turns, lease_s)  # the turns in flight, one per session (turn_lease.py)
        self._turn_ids = TurnIds()
        self.tokens = SessionTokens(session_auth)
        self.counters = counters or Counters()
        self._uncounted_steps = 0  # step tokens encoded since the last flush (see encode_step)
        # each live session's last turn's H19 (what a fork without new tokens routes on)
        self._h19: dict[str, np.ndarray] = {}
        self.prefix_cache = PrefixCache(prefill_chunk, prefix_cache_bytes, f"{engine.model_dir}:{engine.describe()}",
                                        self.counters, self.cfg.window_size)
        self.journal = journal

    def flush_counts(self) -> None:
        """Add the step tokens encoded since the last flush to the counters. Called at every turn's end, so the
        metric is exact whenever no turn is in flight and lags by the tokens of the turns in flight otherwise."""
        if self._uncounted_steps:
            self.counters.add(k.ENCODED_TOKENS, k.STEP, self._uncounted_steps)
            self._uncounted_steps = 0

    # ------------------------------------------------------------------ a user turn
    def encode_turn(self, session_id: str, token_ids: np.ndarray, prefix_ids: np.ndarray | None = None,
                    start: bool = False, session_token: str | None = None, fork_from: str | None = None,
                    fork_token: str | None = None, cache_salt: str | None = None) -> EncodedTurn:
        """Encode a user turn at once (`begin_turn`, every prefill chunk, `finish_turn`): for a caller that has nothing
        else to run meanwhile. A server runs the chunks one at a time between its decode steps (`advance_turn`)."""
        turn = self.begin_turn(session_id, token_ids, prefix_ids, start, session_token, fork_from, fork_token,
                               cache_salt)
        try:
            while not self.advance_turn(turn):
                pass
            return self.finish_turn(turn)
        except BaseException:
            self.abandon_turn(turn)
            raise

    def begin_turn(self, session_id: str, token_ids: np.ndarray, prefix_ids: np.ndarray | None = None,
                   start: bool = False, session_token: str | None = None, fork_from: str | None = None,
                   fork_token: str | None = None, cache_salt: str | None = None) -> "TurnPrefill":
        """Check a user turn and take it in flight -> its prefill, to run chunk by chunk (`advance_turn`) and then
        hand over (`finish_turn`). Nothing is stored until `finish_turn`; a second turn of the session is refused
        from here on.

        A session starts when `start` is set, or is rebuilt when it is not live and `prefix_ids` carries history (more
        than the lone <|bos|>); otherwise a session that is not live is an error. With session tokens on, a live
        session (continued, restarted or sent history) needs its `session_token`, checked before anything that could
        tell a stranger whether the session exists.

        `fork_from` (with `start`): the session starts as a copy of that live, idle session's state (its token in
        `fork_token`), and `token_ids` (maybe none) are encoded after it: n completions of one prompt share its
        prefill this way. With no new tokens the hand-over is empty and H19 is the source's last turn's.

        A starting session (not a fork) takes the longest block-aligned prefix of its tokens that the prefix cache
        holds in its `cache_salt` partition, and prefills only the rest.
        """
        check_session_id(session_id)
        salt = check_salt(cache_salt)
        ids = check_ids(token_ids, self.cfg.vocab_size, "TOKEN_IDS")
        prefix = (check_ids(prefix_ids, self.cfg.vocab_size, "PREFIX_IDS") if prefix_ids is not None
                  else np.zeros(0, np.int64))
        source = None
        if fork_from is not None:
            source = self._fork_source(fork_from, fork_token, start)
        elif ids.size == 0:
            raise BadRequest("TOKEN_IDS is empty")
        existed = self.sessions.contains(session_id)
        restarting = start or fork_from is not None or prefix.size > 1
        resumed = None
        if not existed:  # a journaled session is as good as live: its id opens with its token only
            held = self._journaled(session_id, session_token, continuing=not restarting)
            if held is not None and not restarting:  # checked like any input: the file is not trusted more
                resumed, prefix = held, check_ids(held.tokens, self.cfg.vocab_size, "the journal's history")
        restart = start or (not existed and prefix.size > 1)
        if existed:
            self.check_token(session_id, session_token, k.PATH_TURN)
        elif not restart:
            self._refuse_missing(session_id, session_token)
        self.expire_leases()
        if self.leases.get(session_id) is not None:
            raise BadRequest(f"session {session_id!r} is still answering its previous turn; wait for its final "
                             "response")
        if self.leases.full():
            self.counters.add(k.TURNS_REFUSED, k.BUSY)
            raise ServerBusy(f"server busy: {len(self.leases)} turns in flight (limit {self.max_turns})",
                             self.leases.retry_after_s())
        if source is not None:
            row, ids_all = source.clone(), ids
        elif restart:
            row, ids_all = EncoderRow.empty(self.layout), np.concatenate([prefix, ids])
        else:
            row, ids_all = self._row(session_id).clone(), ids
        before = self._row(session_id) if existed else None  # woken above already, if it rested
        if row.position + ids_all.size > self.max_context:
            self.counters.add(k.TURNS_REFUSED, k.CONTEXT_LIMIT)
            raise BadRequest(f"session {session_id!r} would reach {row.position + ids_all.size} tokens, more than the "
                             f"{self.max_context}-token context limit")
        lease = TurnLease(session_id, before, self.tokens.digest(session_id), self._h19.get(session_id),
                          self._bases.get(session_id))
        turn = TurnPrefill(session_id, lease, row, ids_all, int(ids.size), row.position, existed, restart,
                           fork_h19=None if source is None else self._h19.get(fork_from or ""))
        if resumed is not None:
            turn.resumed, turn.resumed_digest = True, resumed.digest
        if source is not None and self.journal is not None:
            held = self.journal.history(fork_from or "")
            # a source without a journal (dropped over budget, or its write failed): the fork has none either
            turn.journal_prefix = held.tokens if held is not None else np.zeros(0, np.int64)
            turn.journal_skip = held is None
        # the lease holds every cache entry the turn may rest on or restore, pinned from now until it ends
        lease.base_before = self._hold(lease, lease.base_before)
        if source is not None:
            turn.base = self._hold(lease, self._bases.get(fork_from or ""))
        elif not restart:
            turn.base = lease.base_before
        if restart and source is None and self.prefix_cache.enabled:
            turn.salt, turn.chain = salt, self.prefix_cache.chain(salt, ids_all)
            hit = self.prefix_cache.lookup(salt, turn.chain, pin=True)
            if hit is not None:
                lease.pins.append(hit.entry)
                turn.row, turn.done, turn.cached = hit.row, hit.length, hit.length  # the session's own copy
                turn.parts.append(hit.rows)
                turn.base = hit.entry
        self.leases.admit(lease)
        return turn

    def _hold(self, lease: TurnLease, entry: PrefixEntry | None) -> PrefixEntry | None:
        """Pin `entry` for the turn (released with its lease) -> the entry, or None when the cache no longer holds
        it (the turn then keeps its session whole instead of resting on it)."""
        if entry is None or not self.prefix_cache.pin(entry):
            return None
        lease.pins.append(entry)
        return entry

    def advance_turn(self, turn: "TurnPrefill", tokens: int = 0) -> bool:
        """Prefill the turn's next piece -> True once every token is done. A piece is at most `tokens` tokens (0: the
        prefill chunk) and never crosses a multiple of the prefill chunk, so that the prefix cache's block boundaries
        are reached exactly. How a prefill is cut changes no bit of its state or rows (the engines give the same bits
        in chunks of any size: tests/build_engines/export/test_onnx_engines.py), so a turn run alone, between decode
        steps, or from a cache hit ends the same."""
        self._check_live(turn)
        if turn.done < turn.ids.size:
            block = self.prefill_chunk
            end = min(turn.done + (tokens or block), (turn.done // block + 1) * block, turn.ids.size)
            piece = turn.ids[turn.done:end]
            turn.parts.append(self._prefill(turn.row, piece))
            turn.done = end
            stored = len(turn.chain) * self.prefix_cache.block
            if turn.chain and turn.done == stored and stored > turn.cached:  # the longest block-aligned prefix
                stored_entry = self.prefix_cache.insert(turn.salt, turn.chain, turn.row.clone(), _joined(turn.parts),
                                                        pin=True)
                if stored_entry is not None:  # the longest prefix this session shares with the cache
                    turn.lease.pins.append(stored_entry)
                    turn.base = stored_entry
        return turn.done >= turn.ids.size

    def finish_turn(self, turn: "TurnPrefill") -> EncodedTurn:
        """Store the encoded turn and hand it over: H19 pooled over the turn's own tokens, the hand-over rows of every
        position encoded, and the session token when the turn (re)started the session."""
        session_id = turn.session_id
        self._check_live(turn)
        if turn.existed and not turn.restart and not self.sessions.contains(session_id):
            raise UnknownSession(f"session {session_id!r} was evicted while its turn was being encoded; resend the "
                                 "turn with the conversation's history")
        handover = _joined(turn.parts) if turn.parts else self._empty_rows()
        handover["positions"] = np.arange(turn.first, turn.row.position, dtype=np.int64)
        self._store(session_id, turn.row)
        self._set_base(session_id, turn.base)
        if turn.resumed:  # the session goes on under the token its owner holds
            self.tokens.restore(session_id, turn.resumed_digest)
            issued = ""
        else:
            issued = self.tokens.issue(session_id) if turn.restart else ""
        self._track_turn(turn)
        if turn.ids.size - turn.cached:
            self.counters.add(k.ENCODED_TOKENS, k.TURN, int(turn.ids.size - turn.cached))
        rows_h19 = handover.pop("h19")
        if turn.new:
            h19 = rows_h19[-turn.new:].mean(0).astype(np.float32)
        else:
            h19 = turn.fork_h19 if turn.fork_h19 is not None else np.zeros(self.cfg.dim, np.float32)
        self._h19[session_id] = h19
        turn_id = self._turn_ids.next()
        self.leases.hand_over(turn.lease, turn_id)
        return EncodedTurn(h19, handover, issued, turn_id)

    def _check_live(self, turn: "TurnPrefill") -> None:
        if self.leases.get(turn.session_id) is not turn.lease:
            raise UnknownSession(f"session {turn.session_id!r} was ended while its turn was being encoded")

    def _journaled(self, session_id: str, session_token: str | None, continuing: bool):  # -> JournalEntry | None
        """The journal's entry for a session memory does not hold, once its token is checked (None: not journaled).
        Continuing a session whose journal was corrupt at start is refused by name (its owner learns it cannot be
        resumed); starting it again is anyone's, as for an id nobody holds (its token cannot be checked)."""
        if self.journal is None:
            return None
        why = self.journal.refusal(session_id)
        if why is not None and continuing:
            raise UnknownSession(f"session {session_id!r} cannot be resumed: {why}; start it again with new_session "
                                 "or resend the conversation with history")
        entry = self.journal.history(session_id)
        if entry is None:
            return None
        if self.tokens.enabled and not _same_digest(entry.digest, session_token):
            self.counters.add(k.TOKEN_REFUSALS, k.PATH_TURN)
            raise refusal(session_id)
        return entry

    def _track_turn(self, turn: "TurnPrefill") -> None:
        """Start collecting the finished prefill's tokens for the journal (its record is written at the turn's end)."""
        if self.journal is None:
            return
        lease = turn.lease
        if turn.journal_skip:
            self.journal.drop(turn.session_id)
            return
        if turn.journal_prefix is not None:  # a fork: the source's history, then the fork's own tokens
            lease.unjournaled, lease.journal_reset = [turn.journal_prefix, turn.ids], True
        elif turn.resumed:  # the file holds the history already: the rebuild's new turn is appended
            lease.unjournaled, lease.journal_reset = [turn.ids[-turn.new:] if turn.new else turn.ids[:0]], False
        else:
            lease.unjournaled, lease.journal_reset = [turn.ids], turn.restart

    @staticmethod
    def _journal_tokens(lease: TurnLease, tokens: np.ndarray) -> None:
        if lease.unjournaled is not None:
            lease.unjournaled.append(np.asarray(tokens, np.int64).reshape(-1))

    def _commit_journal(self, lease: TurnLease) -> str | None:
        """Write the turn's journal record -> why it could not be written (None: written, or nothing to write)."""
        pending, lease.unjournaled = lease.unjournaled, None
        session_id = lease.session_id
        if self.journal is None or pending is None or not self.sessions.contains(session_id):
            return None
        failures = self.journal.write_failures
        if self.journal.commit(session_id, np.concatenate(pending), self.tokens.digest(session_id),
                               lease.journal_reset) or self.journal.write_failures == failures:
            return None  # written, or not journaled by policy (dropped over the journal's budget: logged there)
        return self.journal.ended_reason(session_id) or "the session's journal could not be written"

    def abandon_turn(self, turn: "TurnPrefill") -> None:
        """Drop a turn that failed or was cancelled before `finish_turn`: nothing was stored, so the session is as it
        was (a prefix the turn already stored in the cache stays: it is whole and right for any session)."""
        self._release(turn.lease, ABANDONED)

    def _fork_source(self, fork_from: str, fork_token: str | None, start: bool) -> EncoderRow:
        """The live, idle session a fork copies (its token checked like a turn's)."""
        if not start:
            raise BadRequest("fork_from starts a session: send it with new_session")
        if not self.sessions.contains(fork_from):
            self._refuse_missing(fork_from, fork_token)
        self.check_token(fork_from, fork_token, k.PATH_TURN)
        if self.leases.get(fork_from) is not None:
            raise BadRequest(f"session {fork_from!r} is answering a turn; fork it once that turn has ended")
        return self._row(fork_from)

    def _empty_rows(self) -> Handover:
        """A hand-over of no rows (a fork that adds no tokens), shaped like the engine's."""
        cfg = self.cfg
        inner = {"streams": ((cfg.hc_mult, cfg.dim), np.float32), "ffn_pre": ((cfg.hc_mult,), np.float32),
                 "topk": ((cfg.index_topk,), np.int64), "candidates": ((cfg.candidate_topk_blocks,), np.int64),
                 "global_kv": ((cfg.head_dim,), np.float32), "index_k": ((cfg.index_head_dim,), np.float32),
                 "h19": ((cfg.dim,), np.float32)}
        return {key: np.zeros((0, *shape), dtype) for key, (shape, dtype) in inner.items()}

    def _refuse_missing(self, session_id: str, token: str | None) -> None:
        """A turn for a session that is not live: its owner learns why (evicted, ended), anyone else is refused."""
        try:
            self.sessions.get(session_id)
        except UnknownSession as reason:
            try:
                self.tokens.check_gone(session_id, token, reason)
            except SessionRefused:
                self.counters.add(k.TOKEN_REFUSALS, k.PATH_TURN)
                raise

    def check_token(self, session_id: str, token: str | None, path: str) -> None:
        """Refuse (the one message, counted under `path`) unless `token` opens this live session, or the journaled
        session memory does not hold yet (a cancel or an end after a restart, before its next turn)."""
        if self.tokens.matches(session_id, token):
            return
        held = self.journal.history(session_id) if self.journal is not None else None
        if (held is not None and not self.sessions.contains(session_id)
                and (not self.tokens.enabled or _same_digest(held.digest, token))):
            return
        self.counters.add(k.TOKEN_REFUSALS, path)
        self.tokens.check(session_id, token)

    def _prefill(self, row: EncoderRow, ids: np.ndarray) -> Handover:
        out = self.engine.encoder(encoder_inputs(self.layout, [row], ids[None], engram=self.engram))
        absorb_encoder(self.layout, [row], out, ids.size, ids[None])
        return {k: out[k][0] for k in HANDOVER_KEYS + ("h19",)}

    # ------------------------------------------------------------------ the decoder's batched steps
    def encode_step(self, session_ids: list[str], tokens: np.ndarray, turn_done: bool = False,
                    keep: np.ndarray | None = None, draft: bool = False,
                    turn_ids: np.ndarray | None = None) -> list[Handover]:
        """One batched step: `tokens` (B, S) are each session's next generated tokens (one row per session).

        Every session must have a turn in flight, and `turn_ids` (B,), when given, name it (its `EncodedTurn.turn_id`):
        a call for a turn that is no longer in flight (its lease expired, its session was evicted and started again)
        fails whole, before any change. A step also claims its turns (`claim`).

        `turn_done` marks the last call of those sessions' turns: the turn is committed (its journal record written)
        and its lease ends; the next user turn is then welcome. The decoder sends it with no tokens once its own side
        of the turn is stored, so that a failure between the turn's last tokens and the decoder's store can still be
        rolled back on both sides (one commit per turn). With tokens, the tokens are encoded and the turn committed at
        once.

        Speculative decoding: with `draft` the step's rows go back to the decoder as usual but are not absorbed; the
        session's next call gives, in `keep` (B,), how many of that step's positions to keep (the token fed last and
        the drafts the decoder accepted, 1..S), and those are absorbed before anything else. -1 (or no `keep`): the
        session has no block waiting. So the accepted length rides on the next call and costs no round trip.
        """
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[0] != len(session_ids) or tokens.dtype.kind not in "iu":
            raise BadRequest(f"step tokens must be an integer (sessions, steps) array, got {tokens.shape} for "
                             f"{len(session_ids)} sessions")
        if len(set(session_ids)) != len(session_ids):
            raise BadRequest("a session appears twice in one step")
        check_ids(tokens.reshape(-1), self.cfg.vocab_size, "STEP_TOKEN_IDS")
        leases = self._step_leases(session_ids, turn_ids)
        keep = self._check_keep(leases, keep)
        rows = [self._row(s) for s in session_ids]
        if draft and (turn_done or tokens.shape[1] == 0):
            raise BadRequest("a speculative step needs tokens and is never the last step of a turn")
        over = [s for s, r, kept in zip(session_ids, rows, keep)
                if r.position + max(kept, 0) + tokens.shape[1] > self.max_context]
        if over:
            raise BadRequest(f"sessions {over} would pass the {self.max_context}-token context limit")
        for lease, row, kept in zip(leases, rows, keep):  # every check passed: the waiting blocks' kept positions
            lease.status = CLAIMED
            if kept >= 0:
                block, lease.draft = lease.draft, None
                assert block is not None
                absorb_encoder(self.layout, [row], block.out, block.tokens.shape[1], block.tokens, keep=[kept])
                self._uncounted_steps += kept
                self._journal_tokens(lease, block.tokens[0, :kept])
        if tokens.shape[1] == 0:  # a commit, or a turn that ends with nothing left to encode (prefill-only, raw)
            if turn_done:
                self._turns_done(leases)
            empty = {key: a for key, a in self._empty_rows().items() if key != "h19"}
            return [{**empty, "positions": np.zeros(0, np.int64)} for _ in session_ids]
        starts = [r.position for r in rows]
        tokens = tokens.astype(np.int64)
        out = self.engine.encoder(encoder_inputs(self.layout, rows, tokens, self.arena, self.engram))
        if draft:
            for b, lease in enumerate(leases):
                lease.draft = DraftBlock({key: v[b:b + 1] for key, v in out.items()}, tokens[b:b + 1])
        else:
            absorb_encoder(self.layout, rows, out, tokens.shape[1], tokens)
            for lease, fed in zip(leases, tokens):
                self._journal_tokens(lease, fed)
            # the count reaches the counters (a Triton metric: an IPC round trip) once per turn end, not once per step
            self._uncounted_steps += int(tokens.size)
        if turn_done:
            self._turns_done(leases)
        steps = tokens.shape[1]
        return [{**{k: out[k][b] for k in HANDOVER_KEYS},
                 "positions": np.arange(starts[b], starts[b] + steps, dtype=np.int64)}
                for b in range(len(session_ids))]

    def _step_leases(self, session_ids: list[str], turn_ids: np.ndarray | None) -> list[TurnLease]:
        """Each step session's lease, checked: handed over or claimed, and the turn `turn_ids` names (if given)."""
        if turn_ids is not None:
            ids = np.asarray(turn_ids)
            if ids.shape != (len(session_ids),) or ids.dtype.kind not in "iu":
                raise BadRequest(f"STEP_TURN_IDS must be one integer per step session ({len(session_ids)}), got "
                                 f"shape {ids.shape} dtype {ids.dtype}")
        leases = []
        for b, s in enumerate(session_ids):
            lease = self.leases.get(s)
            if lease is None or lease.status not in (HANDED_OVER, CLAIMED):
                self._row(s)  # a session that is gone says why (evicted, ended) before "no turn in flight"
                raise BadRequest(f"session {s!r} has no turn in flight (its lease ended); resend the turn")
            if turn_ids is not None and int(turn_ids[b]) != lease.turn_id:
                raise BadRequest(f"session {s!r}: turn {int(turn_ids[b])} is no longer in flight (its lease ended: "
                                 "expired, rolled back or its session was evicted); resend the turn")
            leases.append(lease)
        return leases

    def _check_keep(self, leases: list[TurnLease], keep: np.ndarray | None) -> list[int]:
        """`keep` as one int per session, checked against the blocks waiting: a session with a block must say how
        much of it to keep (1..S), one without must not (a malformed call changes nothing)."""
        if keep is None:
            keep_list = [-1] * len(leases)
        else:
            a = np.asarray(keep)
            if a.shape != (len(leases),) or a.dtype.kind not in "iu":
                raise BadRequest(f"STEP_KEEP must be one integer per step session ({len(leases)}), got shape "
                                 f"{a.shape} dtype {a.dtype}")
            keep_list = [int(v) for v in a]
        for lease, kept in zip(leases, keep_list):
            s, block = lease.session_id, lease.draft
            if block is None and kept != -1:
                raise BadRequest(f"STEP_KEEP: session {s!r} has no speculative step waiting (send -1)")
            if block is not None and not 1 <= kept <= block.tokens.shape[1]:
                raise BadRequest(f"STEP_KEEP: session {s!r} must keep 1..{block.tokens.shape[1]} positions of its "
                                 f"speculative step, got {kept}")
        return keep_list

    # ------------------------------------------------------------------ stored rows
    def _row(self, session_id: str) -> EncoderRow:
        """The session's whole row (a resting one is woken and stored whole again until its turn ends)."""
        value = self.sessions.get(session_id)
        if isinstance(value, RestingRow):
            value = wake(value, self.layout)
            self._store(session_id, value)
        return value

    def _store(self, session_id: str, row: EncoderRow | RestingRow) -> None:
        for evicted in self.sessions.put(session_id, row):
            self.tokens.forget(evicted)
            self._h19.pop(evicted, None)
            lease = self.leases.get(evicted)
            if lease is not None and self._release(lease, EVICTED):  # its decoder's next call is refused
                self.counters.add(k.TURN_LEASES_ENDED, k.LEASE_EVICTED)
            if self.journal is not None:  # an evicted session is gone (its owner resends history), on disk too
                self.journal.drop(evicted)

    def _set_base(self, session_id: str, entry: PrefixEntry | None) -> None:
        """The session now rests on `entry` (pinned for it; None: on nothing). An entry the cache no longer holds is
        not taken: the session stays whole rather than rest on bytes no budget counts."""
        held = self._bases.get(session_id)
        if held is entry:
            return
        if held is not None:
            self.prefix_cache.unpin(held)
            del self._bases[session_id]
        if entry is not None and self.prefix_cache.pin(entry):
            self._bases[session_id] = entry

    def _dropped(self, session_id: str, _: object) -> None:
        """A session evicted or ended: its base is no longer held by it."""
        held = self._bases.pop(session_id, None)
        if held is not None:
            self.prefix_cache.unpin(held)

    def _turns_done(self, leases: list[TurnLease]) -> None:
        """These turns are committed: journaled, their leases ended, and each session rests on its cached prefix.
        A journal write that failed is told to the turn's client (TurnNotDurable) once every turn is committed."""
        lost: list[str] = []
        for lease in leases:
            s = lease.session_id
            why = self._commit_journal(lease)
            if why is not None:
                lost.append(f"session {s!r}: {why}")
            self._release(lease, DONE)
            base = self._bases.get(s)
            value = self.sessions.get(s) if base is not None and self.sessions.contains(s) else None
            if isinstance(value, EncoderRow) and base is not None:
                resting = rest(value, base, self.layout)
                if resting is not None:
                    self._store(s, resting)
        self.flush_counts()
        if lost:
            raise TurnNotDurable("the turn was answered and is kept, but " + "; ".join(lost) + "; do not resend it")

    # ------------------------------------------------------------------ turn bookkeeping
    def _release(self, lease: TurnLease, status: str) -> bool:
        """The one place a turn gives back what it holds: its slot, its pins, its waiting step and unjournaled
        tokens. -> whether the lease was still held (each lease is released once; later calls change nothing)."""
        if not self.leases.remove(lease):
            return False
        lease.status = status
        for entry in lease.pins:
            self.prefix_cache.unpin(entry)
        lease.pins, lease.draft, lease.unjournaled = [], None, None
        return True

    def claim(self, session_id: str, turn_id: int) -> None:
        """The decoder took the turn (it read it, before it waits for a row): its lease no longer expires. A turn
        whose lease ended (expired, rolled back, its session evicted) is refused: the decoder must not run it."""
        self.expire_leases()
        lease = self.leases.get(session_id)
        if lease is None or lease.turn_id != int(turn_id) or lease.status not in (HANDED_OVER, CLAIMED):
            if not self.sessions.contains(session_id):
                self.sessions.get(session_id)  # ended or evicted meanwhile: says which
            raise BadRequest(f"session {session_id!r}: its turn is no longer in flight (the lease ended before the "
                             "decoder took it: expired, rolled back or evicted); resend the turn")
        lease.status = CLAIMED

    def expire_leases(self) -> int:
        """Roll back every handed-over turn its decoder did not claim within the lease -> how many (each counted and
        logged). Run at every admission and claim, so a slot held by an abandoned turn is free when it is needed."""
        expired = self.leases.expired()
        for lease in expired:
            LOG.warning("encoder: the turn of session %r was not claimed by a decoder within %.0f s: rolled back",
                        lease.session_id, self.leases.lease_s)
            self.counters.add(k.TURN_LEASES_ENDED, k.LEASE_EXPIRED)
            self._undo(lease, EXPIRED)
        return len(expired)

    def rollback(self, session_id: str, turn_id: int = 0) -> bool:
        """Undo the session's turn in flight (the decoder rejected it, or failed before committing it). `turn_id`
        (0: whichever is in flight) names the turn: a rollback for a turn no longer in flight changes nothing.
        -> whether a turn was rolled back (False: it was committed already, or its lease ended otherwise)."""
        lease = self.leases.get(session_id)
        if lease is None or (turn_id and lease.turn_id != int(turn_id)):
            return False
        self._undo(lease, ROLLED_BACK)
        return True

    def _undo(self, lease: TurnLease, status: str) -> None:
        """Put the session back as it was before the lease's turn, then release the lease."""
        session_id = lease.session_id
        before, base_before = lease.before, lease.base_before
        if lease.h19_before is None:
            self._h19.pop(session_id, None)
        else:
            self._h19[session_id] = lease.h19_before
        if before is None:
            self.sessions.end(session_id, "rolled back: its first turn was not taken by a decoder within the turn "
                                          "lease" if status == EXPIRED else "ended")
        else:
            self._store(session_id, before)
            self._set_base(session_id, base_before)  # pinned by the lease until the release below
        self.tokens.restore(session_id, lease.token_before)
        self._release(lease, status)

    def end(self, session_id: str) -> bool:
        lease = self.leases.get(session_id)
        if lease is not None:
            self._release(lease, ENDED)
        self._h19.pop(session_id, None)
        self.tokens.forget(session_id)
        if self.journal is not None:
            self.journal.drop(session_id)
        return self.sessions.end(session_id)


def _same_digest(digest: str | None, token: str | None) -> bool:
    """Whether `token` is the one whose digest the journal holds, compared in constant time (session_auth.py)."""
    return hmac.compare_digest(digest or "", token_digest(token) or "-")


def _joined(parts: list[Handover]) -> Handover:
    """Hand-over rows of consecutive pieces (and their H19 rows) as one."""
    return {k: np.concatenate([p[k] for p in parts]) for k in HANDOVER_KEYS + ("h19",)}


def check_ids(ids: np.ndarray | None, vocab: int, name: str) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise BadRequest(f"{name} must be a 1-D integer tensor, got shape {a.shape} dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() >= vocab):
        raise BadRequest(f"{name} holds ids outside [0, {vocab})")
    return a.astype(np.int64)


