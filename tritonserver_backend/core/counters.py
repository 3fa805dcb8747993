"""Routing and replay counters, labelled by adapter; model.py exports them as Triton custom metrics."""

from __future__ import annotations

import threading
from collections import Counter

WRITTEN, READ, APPLIED = "routing_decisions_written", "routing_decisions_read", "routing_decisions_applied"
REPLAYS, REPLAY_TOKENS, EXPLICIT = "replays", "replay_tokens", "explicit_overrides"
REJECTED = "routing_decisions_rejected"
# the encoder's, labelled by kind (TURN: user turns and rebuilt history, STEP: replies)
ENCODED_TOKENS = "encoded_tokens"
TURN, STEP = "turn", "step"
# the decoder's batching, labelled by kind (REPLAY: bounded replays of starting turns, DECODE: one token per turn):
# rows / steps above 1 is what shows that turns of different sessions shared engine calls
DECODER_STEPS, DECODER_ROWS, REPLAY_PADDING = "decoder_steps", "decoder_step_rows", "replay_padding_positions"
REPLAY, DECODE = "replay", "decode"
# user turns the encoder refused before encoding anything, labelled by reason (BUSY: the turns-in-flight bound;
# CONTEXT_LIMIT: the session would pass max_context). Triton's failure counter files both under reason="OTHER".
TURNS_REFUSED = "turns_refused"
BUSY, CONTEXT_LIMIT = "busy", "context_limit"
REFUSAL_REASONS = (BUSY, CONTEXT_LIMIT)
# turns in flight that ended without being committed or rolled back by their decoder (turn_lease.py), labelled by how:
# EXPIRED (handed over, never claimed within the lease: a client that called the encoder alone) or EVICTED (the
# session was evicted for the memory budget while its turn was in flight)
TURN_LEASES_ENDED = "turn_leases_ended"
LEASE_EXPIRED, LEASE_EVICTED = "expired", "evicted"
LEASE_ENDINGS = (LEASE_EXPIRED, LEASE_EVICTED)
# requests refused for a missing or wrong session token, labelled by the path they came by (session_auth.py)
TOKEN_REFUSALS = "session_token_refusals"
PATH_TURN, PATH_CANCEL = "turn", "cancel"
TOKEN_PATHS = (PATH_TURN, PATH_CANCEL)
# speculative decoding, labelled by adapter: blocks verified, tokens drafted into them, drafts accepted
# (accepted / blocks + 1 is the mean tokens a turn gets per decoder step)
SPECULATIVE_BLOCKS, DRAFTED, DRAFTS_ACCEPTED = ("speculative_blocks", "speculative_drafted_tokens",
                                                "speculative_accepted_tokens")
# the encoder's prefix cache (prefix_cache.py), labelled by partition: SHARED (no cache_salt) or SALTED (any salt;
# a salt is never written into a metric). Hits and misses count starting sessions; hit tokens the positions a hit
# did not prefill; evictions the entries dropped for the budget.
PREFIX_HITS, PREFIX_MISSES = "prefix_cache_hits", "prefix_cache_misses"
PREFIX_HIT_TOKENS, PREFIX_EVICTIONS = "prefix_cache_hit_tokens", "prefix_cache_evictions"
PREFIX_SHARED, PREFIX_SALTED = "shared", "salted"
PREFIX_PARTITIONS = (PREFIX_SHARED, PREFIX_SALTED)
DESCRIPTIONS = {
    TURN_LEASES_ENDED: "turns in flight ended by the encoder, not their decoder (expired unclaimed, session evicted)",
    WRITTEN: "routing decisions written by the router (explicit overrides included)",
    READ: "routing decisions read by the decoder",
    APPLIED: "routing decisions applied by the decoder (adapter active, replay done)",
    REJECTED: "routing decisions read but not applied (turn rejected, cancelled before its replay, or failed)",
    REPLAYS: "bounded replays run by the decoder",
    REPLAY_TOKENS: "positions replayed through the decoder",
    EXPLICIT: "requests whose explicit adapter overrode the router",
    DECODER_STEPS: "decoder engine calls (kind=replay: a batch of bounded replays, kind=decode: one token for every "
                   "active turn)",
    DECODER_ROWS: "sessions' rows in those calls (rows / steps is the mean batch size)",
    REPLAY_PADDING: "inert front-padding positions added so that replays of different lengths share one call",
    TURNS_REFUSED: "user turns refused before any state changed (reason=busy: too many turns in flight, retry; "
                   "reason=context_limit: the session would pass max_context)",
    TOKEN_REFUSALS: "requests refused for a missing or wrong session token (path=turn: a turn, end or restart of a "
                    "live session, or a turn for a session that is not live; path=cancel: session_control's cancel)",
    SPECULATIVE_BLOCKS: "speculative blocks verified by the decoder (one turn's drafts in one step)",
    DRAFTED: "tokens drafted into speculative blocks",
    DRAFTS_ACCEPTED: "drafted tokens the target accepted (greedy: equal to its own choice; sampling: speculative "
                     "sampling)",
    PREFIX_HITS: "starting sessions whose prompt began with a cached prefix (partition=shared: no cache_salt; "
                 "partition=salted: a cache_salt)",
    PREFIX_MISSES: "starting sessions the prefix cache had no prefix for",
    PREFIX_HIT_TOKENS: "prompt positions taken from the prefix cache instead of prefilled",
    PREFIX_EVICTIONS: "prefix cache entries dropped for its byte budget (least recently used first)",
    ENCODED_TOKENS: "tokens run through the encoder (kind=turn: user turns and any rebuilt history; kind=step: "
                    "generated tokens fed back)",
}


class Counters:
    """Thread-safe counts keyed by (counter, adapter name); `listener(counter, adapter, amount)` mirrors them."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self.listener = None

    def add(self, counter: str, adapter: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[(counter, adapter)] += amount
        if self.listener is not None:
            self.listener(counter, adapter, amount)

    def get(self, counter: str, adapter: str | None = None) -> int:
        with self._lock:
            return sum(v for (c, a), v in self._counts.items() if c == counter and (adapter is None or a == adapter))
