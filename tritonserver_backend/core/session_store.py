"""Per-session state kept by a model (Python backend has no implicit state): an LRU map with a byte budget."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

from tritonserver_backend.errors import UnknownSession

T = TypeVar("T")


class SessionStore(Generic[T]):
    """Sessions by id, least recently used evicted first once their bytes exceed `budget_bytes`.

    Evicted and ended ids are remembered (bounded) so their next request gets "evicted" or "ended" rather than a
    bare "unknown session". Thread-safe: the decoder serves several sessions from threads.
    """

    def __init__(self, budget_bytes: int, size_of: Callable[[T], int], remember: int = 10_000,
                 on_drop: Callable[[str, T], None] | None = None) -> None:
        """`on_drop(session_id, value)`: called for a session evicted or ended (not for a value replaced by `put`)."""
        self.budget_bytes, self.size_of, self.remember, self.on_drop = budget_bytes, size_of, remember, on_drop
        self._items: OrderedDict[str, T] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.RLock()

    def get(self, session_id: str) -> T:
        with self._lock:
            if session_id not in self._items:
                why = self._gone.get(session_id)
                hint = "resend the turn with `history` to rebuild it, or start it with `new_session`"
                if why is not None:
                    raise UnknownSession(f"session {session_id!r} was {why}; {hint}")
                raise UnknownSession(f"unknown session {session_id!r}; {hint}")
            self._items.move_to_end(session_id)
            return self._items[session_id]

    def peek(self, session_id: str) -> T | None:
        """The session's value without touching its recency (None: not held)."""
        with self._lock:
            return self._items.get(session_id)

    def contains(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._items

    def put(self, session_id: str, value: T) -> list[str]:
        """Store (or replace) a session and evict the least recently used ones over budget; returns evicted ids."""
        with self._lock:
            self._items[session_id] = value
            self._items.move_to_end(session_id)
            self._gone.pop(session_id, None)
            evicted = []
            while len(self._items) > 1 and self.total_bytes() > self.budget_bytes:
                old, value = self._items.popitem(last=False)
                self._forget(old, "evicted (session memory budget)")
                evicted.append(old)
                if self.on_drop is not None:
                    self.on_drop(old, value)
            return evicted

    def end(self, session_id: str, why: str = "ended") -> bool:
        """Drop a session; its next request is told it `why` ("was ended", or another reason the caller names)."""
        with self._lock:
            if session_id not in self._items:
                return False
            value = self._items.pop(session_id)
            self._forget(session_id, why)
            if self.on_drop is not None:
                self.on_drop(session_id, value)
            return True

    def _forget(self, session_id: str, why: str) -> None:
        self._gone[session_id] = why
        while len(self._gone) > self.remember:
            self._gone.popitem(last=False)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(self.size_of(v) for v in self._items.values())

    def __len__(self) -> int:
        return len(self._items)
