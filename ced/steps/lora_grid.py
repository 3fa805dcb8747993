"""Where each position of a decoder step computes its LoRA product: the bank slots the step uses and one grid row
per slot (the decoder graph's `lora_used`, `lora_rows` and `lora_at` inputs; `decoder_step.LoraInputs` says why)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_GRID_ROWS = 2  # onnxruntime's CPU GEMM takes another path for one row (docs/load.md); two and more agree


def lora_grid(slots: Sequence[int], steps: int) -> dict[str, np.ndarray]:
    """The grid inputs for rows whose adapters sit in bank slots `slots`, each row with `steps` positions.

    `lora_used` (U,): the distinct slots, ascending. `lora_rows` (U, C): row u lists the flattened positions
    (b * steps + s) of the rows on slot `lora_used[u]`, in row order, padded to C (at least two) by repeating its
    first position: a padded entry is computed and never read. `lora_at` (B, steps): where each position's result
    is, `u * C + c`."""
    chosen = np.asarray(slots, np.int64)
    if chosen.ndim != 1 or chosen.size == 0:
        raise ValueError(f"a decoder step needs one adapter slot per row, got {chosen.shape}")
    if steps < 1:
        raise ValueError(f"a decoder step needs at least one position per row, got {steps}")
    if (chosen < 0).any():
        raise ValueError(f"adapter slots must be >= 0 (0 = base), got {chosen.tolist()}")
    used, which = np.unique(chosen, return_inverse=True)
    per_slot = np.bincount(which, minlength=used.size) * steps
    width = max(MIN_GRID_ROWS, int(per_slot.max()))
    rows = np.empty((used.size, width), np.int64)
    at = np.empty((chosen.size, steps), np.int64)
    filled = np.zeros(used.size, np.int64)
    offsets = np.arange(steps, dtype=np.int64)
    for b, u in enumerate(which):
        first = filled[u]
        rows[u, first:first + steps] = b * steps + offsets
        at[b] = u * width + first + offsets
        filled[u] += steps
    for u, count in enumerate(filled):
        rows[u, count:] = rows[u, 0]
    return {"lora_used": used, "lora_rows": rows, "lora_at": at}


def row_slots(feed: dict[str, np.ndarray]) -> np.ndarray:
    """Each row's bank slot, read back from a step's grid inputs (for engines that run rows one at a time)."""
    width = feed["lora_rows"].shape[1]
    return feed["lora_used"][feed["lora_at"][:, 0] // width]
