"""The LoRA grid: every position computed once on its own slot, read back from where it was computed."""

from __future__ import annotations

import numpy as np
import pytest

from ced.steps.lora_grid import MIN_GRID_ROWS, lora_grid, row_slots


@pytest.mark.parametrize(("slots", "steps"), [([0], 1), ([3], 1), ([2, 0, 2, 1], 1), ([1, 1, 1], 2), ([4, 0], 5),
                                              ([0, 1, 2, 3, 4] * 3 + [1], 1)])
def test_each_position_reads_its_own_row_on_its_own_slot(slots: list[int], steps: int) -> None:
    grid = lora_grid(slots, steps)
    used, rows, at = grid["lora_used"], grid["lora_rows"], grid["lora_at"]
    assert used.tolist() == sorted(set(slots))
    assert rows.shape[0] == used.size and rows.shape[1] >= MIN_GRID_ROWS and at.shape == (len(slots), steps)
    width = rows.shape[1]
    for b, slot in enumerate(slots):
        for s in range(steps):
            u, c = divmod(int(at[b, s]), width)
            assert used[u] == slot and rows[u, c] == b * steps + s
    # every position is computed exactly once; the rest of a grid row repeats a position of the same slot
    flat = [int(p) for u in range(used.size) for p in rows[u]]
    assert sorted(set(flat)) == list(range(len(slots) * steps))
    for u in range(used.size):
        owners = {slots[int(p) // steps] for p in rows[u]}
        assert owners == {int(used[u])}
    assert row_slots(grid).tolist() == slots


def test_a_single_position_is_padded_to_two_rows() -> None:
    grid = lora_grid([7], 1)
    assert grid["lora_rows"].tolist() == [[0, 0]] and grid["lora_at"].tolist() == [[0]]


@pytest.mark.parametrize(("slots", "steps", "message"),
                         [([], 1, "one adapter slot per row"), ([0, -1], 1, ">= 0"), ([1], 0, "at least one position")])
def test_bad_grids_are_refused(slots: list[int], steps: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lora_grid(np.asarray(slots, np.int64), steps)
