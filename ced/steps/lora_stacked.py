"""Adapters as engine inputs: every loaded adapter stacked into one bank per LoRA group, one slot per adapter.

The decoder graph takes, per group, `lora_a.<group>` and `lora_b.<group>` with a leading slot axis; slot 0 is the
base model (all zeros, so a base row adds exactly 0) and each row of a batch picks its slot. Ranks are padded with
zeros to the largest loaded rank (a zero column adds nothing), and B carries the adapter's alpha / r, so the graph
computes `x W^T + (x A) B`. Stacking is done when the adapter set changes, never per step.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ced.lora.adapter import Adapter
from ced.steps.layout import LoraGroup, StepLayout


def bank_rank(adapters: Sequence[Adapter | None]) -> int:
    return max([a.rank for a in adapters if a is not None] or [1])


def stack_adapters(layout: StepLayout, adapters: Sequence[Adapter | None]) -> dict[str, np.ndarray]:
    """`adapters[i]` fills slot i (None = zeros; slot 0 must be None, the base) -> {input name: array}."""
    if adapters and adapters[0] is not None:
        raise ValueError("slot 0 is the base model and must stay empty")
    groups = layout.lora_groups()
    known = {m for g in groups for m in g.modules}
    for a in adapters:
        if a is not None and set(a.weights) - known:
            raise ValueError(f"adapter {a.name!r} targets modules the decoder graph has no LoRA input for: "
                             f"{sorted(set(a.weights) - known)}")
    slots, rank = max(len(adapters), 1), bank_rank(adapters)
    out: dict[str, np.ndarray] = {}
    for g in groups:
        a_shape, b_shape = layout.lora_shapes(g, slots, rank)
        bank_a, bank_b = np.zeros(a_shape, np.float32), np.zeros(b_shape, np.float32)
        for slot, adapter in enumerate(adapters):
            if adapter is not None:
                _fill(g, bank_a[slot], bank_b[slot], adapter)
        out[f"lora_a.{g.name}"], out[f"lora_b.{g.name}"] = bank_a, bank_b
    return out


def _fill(group: LoraGroup, a_slot: np.ndarray, b_slot: np.ndarray, adapter: Adapter) -> None:
    for i, module in enumerate(group.modules):
        if module not in adapter.weights:
            continue
        a, b = adapter.weights[module]  # (r, in), (out, r)
        r = a.shape[0]
        a_t = a.float().t().numpy()  # (in, r)
        b_t = (b.float() * adapter.scale).t().numpy()  # (r, out)
        if group.kind == "linear":
            a_slot[:, :r], b_slot[:r, :] = a_t, b_t
        elif group.kind == "experts_w13":  # i = expert * 2 + (0: w1, 1: w3)
            a_slot[:, i, :r], b_slot[i, :r, :] = a_t, b_t
        else:  # experts_w2: i = expert
            a_slot[i, :, :r], b_slot[i, :r, :] = a_t, b_t
