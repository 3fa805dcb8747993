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
used entries that nothing holds go first. A hit copies the entry's row for the session to decode with (the engine
needs a session's stores contiguous); between its turns the session rests on the entry, holding only its own entries
(resting_rows.py), and the entry is pinned meanwhile. What one cached token costs is in docs/prefix_cache.md.

Pins when taken. `lookup` and `insert` pin the entry they hand out, under the same lock that finds or stores it (as
vLLM's block pool touches a block when it hands it out): a turn holds every entry it got until its lease ends
(turn_lease.py), so another turn's insert cannot evict an entry between the moment a turn takes it and the moment its
session rests on it. A session then never rests on an entry the cache no longer holds, whose bytes would count in
neither budget. `pin` refuses an entry that is no longer stored.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ced.steps.rows import HANDOVER_FIELDS, EncoderRow
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
    rows: dict[str, np.ndarray]  # the hand-over rows (and "h19") of positions 0 .. length-1 (`trim_rows`)
    partition: str  # the counters' label of the partition it was stored in (its eviction is counted there)
    pins: int = 0  # sessions resting on it and turns using it (resting_rows.py, turn_lease.py): never evicted
    key: bytes = b""  # its key in the cache

    def nbytes(self) -> int:
        return self.row.nbytes() + sum(a.nbytes for a in self.rows.values())


@dataclass(frozen=True)
class PrefixHit:
    length: int
    row: EncoderRow  # the session's own copy
    rows: dict[str, np.ndarray]  # the hand-over rows of positions 0 .. length-1 (`expand_rows`), read-only
    entry: PrefixEntry  # what the session may rest on (`pin`)


def trim_rows(rows: dict[str, np.ndarray], window: int) -> dict[str, np.ndarray]:
    """The hand-over rows an entry keeps: every position's global-KV and index-key entries and H19, and the replay
    window's fields (streams, ffn_pre, top-k, candidates) of the last `window` positions only: the decoder keeps no
    other of those (`DecoderRow._remember`), and they are most of a row's bytes."""
    return {key: a[-window:].copy() if key in HANDOVER_FIELDS else a for key, a in rows.items()}


def expand_rows(rows: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """An entry's rows as a hand-over of `length` rows: the window fields' earlier positions are zeros, which no
    decoder reads (the replay window takes the last rows of a hand-over; a hit's own prefill follows them)."""
    out = {}
    for key, a in rows.items():
        if key in HANDOVER_FIELDS and a.shape[0] < length:
            a = np.concatenate([np.zeros((length - a.shape[0], *a.shape[1:]), a.dtype), a])
        out[key] = a
    return out


class PrefixCache:
    """Block-aligned prefixes of starting sessions -> their encoder state and hand-over rows (thread-safe)."""

    def __init__(self, block: int, budget_bytes: int, engine_digest: str = "",
                 counters: Counters | None = None, window: int = 0) -> None:
        """`window`: the decoder's replay window (positions whose window fields an entry keeps, `trim_rows`; 0: all)."""
        if block < 1:
            raise ValueError(f"the prefix cache's block must hold at least one token, got {block}")
        self.block, self.budget_bytes, self.digest, self.window = block, budget_bytes, engine_digest, window
        self.counters = counters or Counters()
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def total_bytes(self) -> int:
        """Bytes the entries hold (the `mol2_prefix_cache_bytes` gauge)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def chain(self, salt: str, ids: np.ndarray) -> list[bytes]:
        """key(b) for every full block b of `ids`, in order: computed once per starting session, then given to
        `lookup` and `insert`."""
        h = hashlib.sha256(b"mol2-prefix\0" + self.digest.encode() + b"\0" + salt.encode() + b"\0").digest()
        keys = []
        for b in range(ids.size // self.block):
            block = np.ascontiguousarray(ids[b * self.block:(b + 1) * self.block], "<i8").tobytes()
            h = hashlib.sha256(h + block).digest()
            keys.append(h)
        return keys

    def lookup(self, salt: str, keys: list[bytes], pin: bool = False) -> PrefixHit | None:
        """The longest stored prefix whose block keys (`chain`, in `salt`'s partition) start `keys` (None: a miss),
        counted as a hit or a miss; with `pin` the hit's entry is pinned before the lock is let go (`unpin` it)."""
        if not self.enabled:
            return None
        with self._lock:
            for b in range(len(keys) - 1, -1, -1):
                entry = self._entries.get(keys[b])
                if entry is not None:
                    self._entries.move_to_end(keys[b])
                    self.counters.add(k.PREFIX_HITS, _label(salt))
                    self.counters.add(k.PREFIX_HIT_TOKENS, _label(salt), entry.length)
                    if pin:
                        entry.pins += 1
                    return PrefixHit(entry.length, entry.row.clone(), expand_rows(entry.rows, entry.length), entry)
            self.counters.add(k.PREFIX_MISSES, _label(salt))
        return None

    def insert(self, salt: str, keys: list[bytes], row: EncoderRow, rows: dict[str, np.ndarray],
               pin: bool = False) -> PrefixEntry | None:
        """Store the state after the blocks `keys` name (`chain`: a prefix of a session's chain) and the rows of
        their positions; the caller gives copies this cache owns. -> the entry now stored under those keys (an equal
        one already there is kept), pinned with `pin`, or None when it does not fit: larger than the budget, or every
        entry it would have to evict is pinned."""
        if not self.enabled or not keys:
            return None
        key = keys[-1]
        entry = PrefixEntry(len(keys) * self.block, row, trim_rows(rows, self.window) if self.window else rows,
                            _label(salt), key=key)
        size = entry.nbytes()
        if size > self.budget_bytes:
            return None
        with self._lock:
            held = self._entries.get(key)
            if held is not None:
                self._entries.move_to_end(key)
                if pin:
                    held.pins += 1
                return held
            while self._bytes + size > self.budget_bytes:
                victim = next((k for k, e in self._entries.items() if not e.pins), None)
                if victim is None:  # everything left is some session's base
                    return None
                old = self._entries.pop(victim)
                self._bytes -= old.nbytes()
                self.counters.add(k.PREFIX_EVICTIONS, old.partition)
            self._entries[key] = entry
            self._bytes += size
            if pin:
                entry.pins += 1
        return entry

    def pin(self, entry: PrefixEntry) -> bool:
        """Hold `entry` (a session resting on it, a turn using it): keep it, and count its bytes, until `unpin`.
        False, and nothing held, when the cache no longer stores it (evicted): its holder must not rely on it."""
        with self._lock:
            if not self._stored(entry):
                return False
            entry.pins += 1
            return True

    def unpin(self, entry: PrefixEntry) -> None:
        with self._lock:
            if entry.pins <= 0:
                raise RuntimeError("a prefix-cache entry was unpinned more often than pinned")
            entry.pins -= 1

    def holds(self, entry: PrefixEntry) -> bool:
        """Whether `entry` is stored (not evicted)."""
        with self._lock:
            return self._stored(entry)

    def _stored(self, entry: PrefixEntry) -> bool:
        return self._entries.get(entry.key) is entry

    def pinned(self) -> int:
        """Entries some session holds as its base."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.pins)


def _label(salt: str) -> str:
    """The counters' partition label: shared, or salted (a salt itself is never written into a metric)."""
    return k.PREFIX_SHARED if salt == SHARED else k.PREFIX_SALTED
