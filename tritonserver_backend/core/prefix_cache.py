"""The encoder's prefix cache: sessions that start with the same tokens share one prefill of them, under every adapter.

No LoRA touches layers 0-19 or layer 20's attention, so a prefix's encoder state and its hand-over rows (layer 20's
output, the global-KV and index-key entries, H19) are the same whatever adapter later answers, and whatever version
of it: one cached prefix serves them all. The decoder still runs its bounded replay of the last window under the turn's
adapter, as for every turn, so nothing adapter-dependent is ever cached.

Keys. Block-aligned prefixes: block b of a token sequence is keyed by a hash chain, key(b) = sha256(key(b-1) ||
tokens of block b), rooted at the engine's digest (a cache never outlives its engines' meaning) and the partition (the
request's `cache_salt`; "" is the shared partition). A lookup walks the chain and takes the longest prefix stored; an
entry holds the encoder row at its last position and the hand-over rows of every position before it.

Exact. The block length is the encoder's prefill chunk, and a session's prefill chunks start at position 0, so a hit
at P leaves the remaining chunks on the same boundaries as the cold prefill: the engine runs the very same calls, and
the hit's rows, the decoder's replay and every reply are the same bits as without the cache.

Budget. Entries are counted in bytes (`nbytes`) against `budget_bytes`, beside the session budget; the least recently
used entries go first. A hit copies the entry's row for the session (copy-on-take), so an entry is never in use after
`lookup` returns and eviction never waits. What this version does not do yet: share the prefix's global-KV bytes by
reference between the sessions that took it (each session holds its own copy, as without the cache); what one cached
token costs is in docs/prefix_cache.md.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ced.steps.rows import EncoderRow
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.errors import BadRequest

MAX_SALT_CHARS = 256
DEFAULT_BUDGET_BYTES = 256 << 20  # the servers' default prefix_cache_bytes (Triton repository, Dynamo workers)
SHARED = ""  # the partition of requests without a cache_salt


def check_salt(salt: object) -> str:
    """A request's `cache_salt`: a string of at most 256 printable characters ("" or None: the shared partition)."""
    if salt is None:
        return SHARED
    if isinstance(salt, bytes):
        try:
            salt = salt.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("cache_salt must be UTF-8 text") from None
    if not isinstance(salt, str):
        raise BadRequest(f"cache_salt must be a string, got {type(salt).__name__}")
    if len(salt) > MAX_SALT_CHARS or not salt.isprintable():
        raise BadRequest(f"cache_salt must be at most {MAX_SALT_CHARS} printable characters")
    return salt


@dataclass
class PrefixEntry:
    length: int  # positions covered: a multiple of the block length
    row: EncoderRow  # the encoder state after `length` positions
    rows: dict[str, np.ndarray]  # the hand-over rows (and "h19") of positions 0 .. length-1

    def nbytes(self) -> int:
        return self.row.nbytes() + sum(a.nbytes for a in self.rows.values())


@dataclass(frozen=True)
class PrefixHit:
    length: int
    row: EncoderRow  # the session's own copy
    rows: dict[str, np.ndarray]  # shared, read-only: concatenated into the turn's hand-over, never written


class PrefixCache:
    """Block-aligned prefixes of starting sessions -> their encoder state and hand-over rows (thread-safe)."""

    def __init__(self, block: int, budget_bytes: int, engine_digest: str = "",
                 counters: Counters | None = None) -> None:
        if block < 1:
            raise ValueError(f"the prefix cache's block must hold at least one token, got {block}")
        self.block, self.budget, self.digest = block, budget_bytes, engine_digest
        self.counters = counters or Counters()
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def budget_bytes(self) -> int:
        return self.budget

    def total_bytes(self) -> int:
        """Bytes the entries hold (the `mol2_prefix_cache_bytes` gauge)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _keys(self, salt: str, ids: np.ndarray) -> list[bytes]:
        """key(b) for every full block b of `ids`, in order."""
        h = hashlib.sha256(b"mol2-prefix\0" + self.digest.encode() + b"\0" + salt.encode() + b"\0").digest()
        keys = []
        for b in range(ids.size // self.block):
            block = np.ascontiguousarray(ids[b * self.block:(b + 1) * self.block], "<i8").tobytes()
            h = hashlib.sha256(h + block).digest()
            keys.append(h)
        return keys

    def lookup(self, salt: str, ids: np.ndarray) -> PrefixHit | None:
        """The longest stored prefix of `ids` in `salt`'s partition (None: a miss), counted as a hit or a miss."""
        if not self.enabled:
            return None
        keys = self._keys(salt, ids)
        with self._lock:
            for b in range(len(keys) - 1, -1, -1):
                entry = self._entries.get(keys[b])
                if entry is not None:
                    self._entries.move_to_end(keys[b])
                    self.counters.add(k.PREFIX_HITS, _label(salt))
                    self.counters.add(k.PREFIX_HIT_TOKENS, _label(salt), entry.length)
                    return PrefixHit(entry.length, entry.row.clone(), entry.rows)
            self.counters.add(k.PREFIX_MISSES, _label(salt))
        return None

    def longest_block(self, ids: np.ndarray) -> int:
        """The longest block-aligned prefix of `ids` an entry could cover."""
        return ids.size // self.block * self.block

    def insert(self, salt: str, ids: np.ndarray, row: EncoderRow, rows: dict[str, np.ndarray]) -> bool:
        """Store the state after `ids` (whole blocks) and the rows of its positions; the caller gives copies this
        cache owns. False when it does not fit the budget at all (nothing stored)."""
        if not self.enabled or ids.size == 0 or ids.size % self.block:
            return False
        key = self._keys(salt, ids)[-1]
        entry = PrefixEntry(int(ids.size), row, rows)
        size = entry.nbytes()
        if size > self.budget:
            return False
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            while self._entries and self._bytes + size > self.budget:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes()
                self.counters.add(k.PREFIX_EVICTIONS, _label(salt))
            self._entries[key] = entry
            self._bytes += size
        return True


def _label(salt: str) -> str:
    """The counters' partition label: shared, or salted (a salt itself is never written into a metric)."""
    return k.PREFIX_SHARED if salt == SHARED else k.PREFIX_SALTED
