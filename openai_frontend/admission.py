"""Requests in flight per API key: one tenant cannot take every turn slot of the server behind the frontend.

Why here: the server counts turns in flight against one bound for everyone (`max_active_turns` + `max_queued_turns`,
96 by default) and knows no tenant; the frontend is where a request's identity (its API key) is known. So each key may
hold at most `limit` requests in flight (a streamed reply counts until its last event is sent); one over that is
answered 429 with Retry-After at once, before anything reaches the server. The default, 48, is half the server's
default slots: one busy tenant leaves the other half to everyone else.
"""

from __future__ import annotations

import threading

DEFAULT_PER_KEY = 48


class KeyAdmission:
    """In-flight counts by key namespace (`prefix_cache.namespace_of`: a digest, never the key itself)."""

    def __init__(self, limit: int = DEFAULT_PER_KEY) -> None:
        if limit < 0:
            raise ValueError(f"the per-key limit must be 0 (none) or positive, got {limit}")
        self.limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, namespace: str) -> bool:
        """Take a slot for this key -> False when it already holds `limit` (nothing taken)."""
        with self._lock:
            held = self._held.get(namespace, 0)
            if self.limit and held >= self.limit:
                return False
            self._held[namespace] = held + 1
            return True

    def release(self, namespace: str) -> None:
        with self._lock:
            held = self._held.get(namespace, 0) - 1
            if held < 0:
                raise RuntimeError("a key's request slot was released more often than taken")
            if held:
                self._held[namespace] = held
            else:
                self._held.pop(namespace, None)

    def held(self, namespace: str) -> int:
        with self._lock:
            return self._held.get(namespace, 0)
