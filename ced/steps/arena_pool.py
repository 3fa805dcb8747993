"""A few step arenas, one per decode lane, so that batches which alternate do not restack each other every step.

The decoder's scheduler may split its active turns into lanes whose steps alternate (while one lane's decoder step
runs, the next lane's encoder step runs in the encoder process: `tritonserver_backend/core/scheduler.py`). One arena per
service would then hold lane A's rows, be asked for lane B's, rebuild, be asked for lane A's again and rebuild again:
every step would copy every row's rings and stores. The pool keeps one arena per row set it has seen recently and
hands each batch the arena that already holds exactly its rows; a new row set takes over the least recently used one.

A row lives in at most one arena's batch arrays at a time: the arena that stacks it last rebinds the row's fields to
its own views, and any other arena that still lists the row sees (by identity, `StepArena._holds`) that the row no
longer points into it and rebuilds before its next step. So the inputs stay exactly what fresh stacking would give.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ced.steps.arena import ArenaField, StepArena


class ArenaPool:
    """`stack(rows, fields)` like `StepArena.stack`, with up to `size` row sets kept stacked at once."""

    def __init__(self, size: int = 2) -> None:
        if size < 1:
            raise ValueError("an arena pool needs at least one arena")
        self._arenas = [StepArena() for _ in range(size)]
        self._holding: list[tuple[int, ...]] = [() for _ in range(size)]  # row ids each arena was last stacked for
        self._order = list(range(size))  # least recently used first

    @property
    def rebuilds(self) -> int:
        return sum(a.rebuilds for a in self._arenas)

    def stack(self, rows: list[Any], fields: list[ArenaField]) -> dict[str, np.ndarray]:
        key = tuple(id(r) for r in rows)  # the arena keeps its rows alive, so their ids cannot be reused meanwhile
        index = self._holding.index(key) if key in self._holding else self._order[0]
        self._order.remove(index)
        self._order.append(index)
        self._holding[index] = key
        return self._arenas[index].stack(rows, fields)
