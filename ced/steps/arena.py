"""Batch arrays that stay put between decode steps, so a batch of sessions is not restacked every token.

A batched step needs each state field of its rows as one contiguous (B, ...) array. Stacking them afresh every step
copies every row's window rings and global-KV stores (megabytes at 16 sessions) for a step that changes one row of
each. Instead, when a batch is formed, the arena copies the rows' arrays into batch arrays once and rebinds each row's
field to its slice (a view), so the step's writes (`absorb_*`, in place) land in the batch arrays directly and the next
step with the same rows passes them as they are. The arena rebuilds itself (and hands departed rows copies of their
own) when the rows change, a row's array is replaced (a store outgrew the batch length, a replay restarted the rings,
a rollback put back an older state) or the step needs stores of another length. The inputs are exactly what stacking
would give: same rows, same padded lengths, same values, so outputs are bit for bit the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class ArenaField:
    """One state field of a row: the feed name, how to read and rebind it, and the entries the step needs along
    axis 0 (None: the array's own shape, e.g. a ring)."""

    key: str
    get: Callable[[Any], np.ndarray]
    put: Callable[[Any, np.ndarray], None]
    length: int | None = None


class StepArena:
    def __init__(self) -> None:
        self._rows: list[Any] = []
        self._arrays: dict[str, np.ndarray] = {}
        self._views: dict[str, list[np.ndarray]] = {}
        self._fields: dict[str, ArenaField] = {}
        self.rebuilds = 0

    def stack(self, rows: list[Any], fields: list[ArenaField]) -> dict[str, np.ndarray]:
        """The batch arrays of `fields` for `rows` (in this order), rebuilt only when they no longer hold the rows."""
        if not self._holds(rows, fields):
            self._rebuild(rows, fields)
        return {f.key: self._arrays[f.key] for f in fields}

    def _holds(self, rows: list[Any], fields: list[ArenaField]) -> bool:
        if len(rows) != len(self._rows) or any(a is not b for a, b in zip(rows, self._rows)):
            return False
        for f in fields:
            views = self._views.get(f.key)
            if views is None or (f.length is not None and self._arrays[f.key].shape[1] != f.length):
                return False
            if any(f.get(r) is not v for r, v in zip(rows, views)):
                return False
        return True

    def _rebuild(self, rows: list[Any], fields: list[ArenaField]) -> None:
        self._release(keep={id(r) for r in rows})
        for f in fields:
            own = [f.get(r) for r in rows]
            if f.length is None:
                batch = np.stack(own)
            else:
                batch = np.zeros((len(rows), f.length) + own[0].shape[1:], own[0].dtype)
                for b, a in enumerate(own):
                    n = min(f.length, a.shape[0])
                    batch[b, :n] = a[:n]
            views = [batch[b] for b in range(len(rows))]
            for r, v in zip(rows, views):
                f.put(r, v)
            self._arrays[f.key], self._views[f.key], self._fields[f.key] = batch, views, f
        self._rows = list(rows)
        self.rebuilds += 1

    def _release(self, keep: set[int]) -> None:
        """Rows leaving the batch get their own copies, so the old batch arrays are not kept alive by their views."""
        for key, views in self._views.items():
            f = self._fields[key]
            for r, v in zip(self._rows, views):
                if id(r) not in keep and f.get(r) is v:
                    f.put(r, v.copy())
        self._rows, self._arrays, self._views, self._fields = [], {}, {}, {}
