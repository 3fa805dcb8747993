"""Idle sessions that hold a cached prefix keep only what is their own: the prefix's global-KV and index-key entries
are shared, by reference, with the prefix cache's entry they started from.

An encoder session's state is its small per-session tail (SWA rings, compressor pending pairs, Engram's n-gram
history) and its global-KV and index-key stores, which only grow: an entry, once written, never changes. So the first
`length` positions' entries of every session that started from a cached prefix of `length` tokens (or stored it)
are the entry's own, bit for bit. While a session decodes, the engine needs its stores contiguous, so an active
session holds a full copy; between its turns (most of a chat session's life) it rests as a `RestingRow`: the
entries after the prefix and its tail, with the cache entry as its base. Eight sessions opening with one 4 K-token
system prompt hold that prompt's entries once, in the cache, instead of nine times (docs/prefix_cache.md, "State
bytes").

Resting is checked, not assumed: a row rests only if its first entries equal the base's (a byte compare of the
prefix, far cheaper than the copy every continuing turn already makes when it starts), and waking concatenates the
base's entries and the row's own, giving back the very arrays the row had. The cache pins an entry while any session
holds it as a base (`PrefixCache.pin`), so a base is never evicted from under its sessions and its bytes are counted
once, in the cache's budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ced.steps.layout import StepLayout
from ced.steps.rows import EncoderRow
from tritonserver_backend.core.prefix_cache import PrefixEntry


@dataclass
class RestingRow:
    """An idle session's encoder state without its base's entries (see the module docstring)."""

    base: PrefixEntry
    position: int
    rings: np.ndarray
    kv_tail: dict[int, np.ndarray]  # source -> the entries after the base's
    index_k_tail: dict[int, np.ndarray]
    pending: dict[int, np.ndarray]
    engram_recent: np.ndarray

    def nbytes(self) -> int:
        """Bytes this session holds of its own (the base's are the cache's)."""
        return self.rings.nbytes + self.engram_recent.nbytes + sum(
            a.nbytes for d in (self.kv_tail, self.index_k_tail, self.pending) for a in d.values())


def rest(row: EncoderRow, base: PrefixEntry, layout: StepLayout) -> RestingRow | None:
    """`row` as a resting row on `base`, or None when its first entries are not the base's (it then stays whole)."""
    if row.position < base.length:
        return None
    kv_tail, index_k_tail = {}, {}
    for s in layout.sources:
        shared, used = base.row.used(layout, s), row.used(layout, s)
        if not (np.array_equal(row.kv[s][:shared], base.row.kv[s][:shared])
                and np.array_equal(row.index_k[s][:shared], base.row.index_k[s][:shared])):
            return None
        kv_tail[s] = row.kv[s][shared:used].copy()
        index_k_tail[s] = row.index_k[s][shared:used].copy()
    return RestingRow(base, row.position, row.rings.copy(), kv_tail, index_k_tail,
                      {s: p.copy() for s, p in row.pending.items()}, row.engram_recent.copy())


def wake(resting: RestingRow, layout: StepLayout) -> EncoderRow:
    """The whole row again: the base's entries, then the row's own."""
    base = resting.base.row
    kv = {s: np.concatenate([base.kv[s][:base.used(layout, s)], resting.kv_tail[s]]) for s in layout.sources}
    index_k = {s: np.concatenate([base.index_k[s][:base.used(layout, s)], resting.index_k_tail[s]])
               for s in layout.sources}
    return EncoderRow(resting.position, resting.rings.copy(), kv, index_k,
                      {s: p.copy() for s, p in resting.pending.items()}, resting.engram_recent.copy())
