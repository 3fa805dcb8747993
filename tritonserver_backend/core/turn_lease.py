"""A user turn's hold on the encoder, from admission to its end: one object with a status, one table of them.

Why leases: a turn takes one of the encoder's admission slots when it arrives (the bound on turns in flight), and
before leases only the decoder's calls gave the slot back. A client that called the `encoder` model directly and never
continued to the decoder kept its slot for good, and 96 such calls locked every user of the server out. Now a turn
that has been handed over must be claimed by its decoder within `lease_s` (the decoder claims it the moment it reads
the turn, before it waits for a row: a turn queued behind a busy batch is claimed, so it never expires in the queue).
An unclaimed lease expires: its turn is rolled back and its slot is free again. A claimed lease ends when its turn is
committed, rolled back, or its session is evicted or ended.

The lease also carries what the turn holds: the session's state before it (what a rollback restores), the prefix-cache
entries it pinned (every entry the turn took from or stored into the cache, pinned at that moment, so no other turn's
insert can evict it from under this one), the tokens not yet journaled, and a speculative step waiting for its kept
length. Taking those happens when the lease is admitted and as the turn goes; giving every one of them back happens in
one place (`EncoderService._release`), so a new way for a turn to end cannot leak a slot or a pin.

A turn's id is the encoder's clock in nanoseconds when it was handed over (strictly increasing): the hand-over's grant
signs it (session_auth.py), so the decoder learns it from the grant it checks anyway, and names it on every call it
makes for the turn. A call that names another id (a decoder still holding a turn whose lease expired) changes nothing.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from ced.steps.rows import EncoderRow
    from tritonserver_backend.core.prefix_cache import PrefixEntry

# How long a handed-over turn waits for its decoder to claim it. Far below the grant's 300 s (GRANT_TTL_S): inside
# one server the decoder reads a turn milliseconds after the encoder hands it over (the ensemble's next step); only a
# client that called the encoder alone leaves a turn unclaimed, and such a turn holds its slot this long at most.
DEFAULT_LEASE_S = 30.0

PREFILLING, HANDED_OVER, CLAIMED = "prefilling", "handed_over", "claimed"
DONE, ROLLED_BACK, EXPIRED = "done", "rolled_back", "expired"
EVICTED, ENDED, ABANDONED = "evicted", "ended", "abandoned"


@dataclass
class DraftBlock:
    """A speculative step's outputs for one session, not absorbed yet: the next step call says how many of its
    positions to keep (the last fed token and the accepted drafts), and only those are written (`absorb_encoder`'s
    `keep`: the state is then that of a session that never saw the rest)."""

    out: dict[str, np.ndarray]  # the step's outputs, this session's row only (1, …)
    tokens: np.ndarray  # (1, S)


@dataclass(eq=False)
class TurnLease:
    """One user turn in flight on the encoder (see the module docstring)."""

    session_id: str
    before: "EncoderRow | None"  # the state before the turn (None: the turn started the session)
    token_before: str | None = None  # the session's token digest before the turn (None: it had none)
    h19_before: np.ndarray | None = None  # the session's last turn's H19 before the turn (what a fork routes on)
    base_before: "PrefixEntry | None" = None  # the cached prefix the session rested on before the turn
    status: str = PREFILLING
    turn_id: int = 0  # set at the hand-over
    deadline: float = math.inf  # time.monotonic() by which a handed-over turn must be claimed
    pins: list["PrefixEntry"] = field(default_factory=list)  # cache entries this turn holds (released with it)
    unjournaled: list[np.ndarray] | None = None  # the turn's tokens for the journal (None: not journaled)
    journal_reset: bool = False  # its record restarts the session's file (a start, a restart, a fork)
    draft: DraftBlock | None = None  # a speculative step waiting for its kept length


class TurnIds:
    """Turn ids: the clock in nanoseconds, strictly increasing within the process (so a grant that signs one is
    newer than every grant before it, which the decoder's ledger requires)."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._last = max(time.time_ns(), self._last + 1)
            return self._last


class LeaseTable:
    """The live leases by session (one per session), bounded by `limit` (0: no bound); thread-safe for readers."""

    def __init__(self, limit: int, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s < 0:
            raise ValueError(f"a turn lease must be 0 (never expires) or positive seconds, got {lease_s}")
        self.limit, self.lease_s, self.clock = limit, lease_s, clock
        self._by_session: dict[str, TurnLease] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_session)

    def get(self, session_id: str) -> TurnLease | None:
        return self._by_session.get(session_id)

    def full(self) -> bool:
        return bool(self.limit) and len(self._by_session) >= self.limit

    def admit(self, lease: TurnLease) -> None:
        """Hold `lease` for its session (the caller checked `full` and that the session has none)."""
        with self._lock:
            assert lease.session_id not in self._by_session, "one turn per session"
            self._by_session[lease.session_id] = lease

    def hand_over(self, lease: TurnLease, turn_id: int) -> None:
        """The turn's rows went to the client or the decoder: from now on it must be claimed within `lease_s`."""
        lease.status, lease.turn_id = HANDED_OVER, turn_id
        lease.deadline = self.clock() + self.lease_s if self.lease_s else math.inf

    def expired(self) -> list[TurnLease]:
        """Handed-over leases whose decoder never claimed them in time (the caller rolls them back)."""
        now = self.clock()
        return [lease for lease in list(self._by_session.values())
                if lease.status == HANDED_OVER and lease.deadline <= now]

    def retry_after_s(self) -> float:
        """When a slot frees at the latest without any turn finishing: the soonest unclaimed lease's expiry (a
        client told to retry then finds a slot unless others took it first); 1 s when every lease is claimed."""
        deadlines = [lease.deadline for lease in self._by_session.values()
                     if lease.status == HANDED_OVER and math.isfinite(lease.deadline)]
        return max(1.0, min(deadlines) - self.clock()) if deadlines else 1.0

    def remove(self, lease: TurnLease) -> bool:
        """Stop holding `lease` -> whether it was the one held (a lease is removed once)."""
        with self._lock:
            if self._by_session.get(lease.session_id) is not lease:
                return False
            del self._by_session[lease.session_id]
            return True
