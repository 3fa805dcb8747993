"""Conversation prefix -> the server session that holds it, so a conversation continued by resending its messages
(the OpenAI API is stateless) reuses the session's encoder state and global KV instead of re-encoding everything.

A key is the SHA-256 of the exact message list (roles and contents) the session has absorbed: its earlier turns and
the reply the server gave, as the frontend returned it. The model id is not part of it: every adapter shares one
history (the encoder state and global KV do not depend on the adapter), so a conversation that continues under another
model id (`mol2:L2_code` after `mol2`, say) continues the same session and the server switches adapter with a bounded
replay, instead of re-encoding the whole conversation. A request looks up the key of its messages
before the new user message: the longest prefix a session can continue from, because the tensor API appends a user
turn and then the server's own reply, and cannot absorb assistant text it did not generate. Any other prefix
(edited history, a lost entry) is rebuilt from the messages with the `history` input.

With API keys configured the cache is partitioned by the key a request presented: the key's SHA-256 (`namespace`) is
mixed into the cache key, so the same messages sent under two keys never reach the same session (one tenant cannot
continue, or even detect, another's conversation). Without keys there is one namespace. An entry also holds the
session's token (the server's issued_session_token), which every later turn of the session must present; the key of
the cache never holds an API key itself, only its digest.

`take` removes the entry it returns: a session serves one request at a time, so two concurrent requests that resend
the same conversation never share (or see) one session; the second rebuilds its own. The turn's outcome is stored
under its new key with `put`. Entries are evicted least recently used once their estimated bytes pass the budget
(the server's `session_budget_bytes`; it evicts its own sessions by the same rule, and a session the server dropped
first is detected at the next turn and rebuilt).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from openai_frontend.schemas import Message
from openai_frontend.session_cost import SessionCost


def namespace_of(api_key: str | None) -> str:
    """The cache namespace of requests that presented `api_key`: its hex SHA-256; "" without keys (one namespace)."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest() if api_key else ""


def cache_salt_of(namespace: str) -> str | None:
    """The server's `cache_salt` for requests of this namespace: a digest of it (the API key never leaves the
    frontend), None without API keys (the server's shared partition). Each key then has its own partition of the
    encoder's prefix cache too: another tenant can neither take its prefixes nor time them (docs/prefix_cache.md)."""
    return hashlib.sha256(b"mol2-cache-salt\0" + namespace.encode()).hexdigest()[:32] if namespace else None


def prefix_key(messages: Sequence[Message], namespace: str = "") -> str:
    """The cache key of a message list within a namespace (`namespace_of`; "" without API keys)."""
    canonical = json.dumps([list(m) for m in messages], ensure_ascii=False, separators=(",", ":"))
    salt = f"{namespace}\x00" if namespace else ""
    return hashlib.sha256((salt + canonical).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Entry:
    session_id: str
    tokens: int  # positions the session holds (what its bytes grow with)
    session_token: str = field(default="", repr=False)  # the server's token for the session ("" with session_auth off)


class PrefixCache:
    def __init__(self, budget_bytes: int, cost: SessionCost) -> None:
        self.budget_bytes, self.cost = budget_bytes, cost
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def take(self, key: str) -> Entry | None:
        """Claim the session holding this prefix (removed: nobody else may continue it meanwhile)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                self.misses += 1
                return None
            self.hits += 1
            self._bytes -= self.cost.bytes(entry.tokens)
            return entry

    def put(self, key: str, entry: Entry) -> list[Entry]:
        """Remember a session under the prefix it now holds; returns the entries evicted to stay within the budget."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= self.cost.bytes(old.tokens)
            self._entries[key] = entry
            self._bytes += self.cost.bytes(entry.tokens)
            evicted = []
            while len(self._entries) > 1 and self._bytes > self.budget_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= self.cost.bytes(gone.tokens)
                evicted.append(gone)
            self.evictions += len(evicted)
            return evicted

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
