"""One rank's slice of the stacked LoRA bank, cut the way its base weights are cut.

An adapter's product x A B sits beside a base projection x W^T, so it splits with it (as vLLM's
`ColumnParallelLinearWithLoRA` / `RowParallelLinearWithLoRA` do):

- a column-parallel projection (rows of W split: `wq_b`, the indexer's `wq_b` and `weights_proj`, every expert's w1
  and w3 under tensor parallelism) keeps A whole and takes the same rows of B, so the rank computes exactly its output
  slice of the adapter's product;
- a row-parallel projection (input columns of W split: `wo_b`, every expert's w2 under tensor parallelism) takes the
  same rows of A and keeps B whole: x_r A_r B is a partial product the all-reduce after attention or the MoE adds up
  with the base partials, sum_r x_r A_r B = x A B, so no collective of its own;
- a replicated projection (`wq_a`, `wkv`) keeps the whole adapter, computed alike on every rank;
- expert parallelism keeps the experts a rank owns (and rank 0 the shared expert), whole.

The bank is numpy (`ced.steps.lora_stacked`): the runtime's leader sends it, every rank cuts its own.
"""

from __future__ import annotations

import numpy as np

from ced.model.config import CEDConfig
from ced.parallel.layout import ParallelLayout, Shard, sharding_plan
from ced.steps.layout import LoraGroup, StepLayout

Bank = dict[str, np.ndarray]


class LoraShards:
    """Cuts banks for one rank; the sharding plan is read once."""

    def __init__(self, cfg: CEDConfig, layout: ParallelLayout) -> None:
        self.cfg, self.layout = cfg, layout
        self.groups = StepLayout(cfg).lora_groups()
        self.plan = sharding_plan(cfg, layout)

    def _shard(self, module: str) -> Shard:
        return self.plan[f"{module}.weight"][0]

    def cut(self, bank: Bank) -> Bank:
        """This rank's bank: every `lora_a.<group>` / `lora_b.<group>` of `bank` cut to the rank's shard (arrays
        that are not LoRA groups pass through)."""
        out = dict(bank)
        for group in self.groups:
            a_key, b_key = f"lora_a.{group.name}", f"lora_b.{group.name}"
            if a_key not in bank:
                continue
            out[a_key], out[b_key] = self._cut_group(group, bank[a_key], bank[b_key])
        return out

    def _cut_group(self, group: LoraGroup, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if group.kind == "linear":  # A (U, in, R), B (U, R, out)
            shard = self._shard(group.modules[0])
            if shard.kind == "split" and shard.dim == 0:
                return a, np.ascontiguousarray(b[..., shard.start:shard.stop])
            if shard.kind == "split" and shard.dim == 1:
                return np.ascontiguousarray(a[:, shard.start:shard.stop]), b
            if shard.kind != "replicated":
                raise ValueError(f"{group.name}: a LoRA on a {shard.kind} projection has no cut")
            return a, b
        # expert groups: the experts' module names, routed then shared (w13 lists each expert's w1 then w3)
        experts = [m.rsplit(".", 1)[0] for m in group.modules[:: 2 if group.kind == "experts_w13" else 1]]
        weight = "w1" if group.kind == "experts_w13" else "w2"
        shards = [self._shard(f"{e}.{weight}") for e in experts]
        held = [g for g, s in enumerate(shards) if s.held]
        split = {(s.start, s.stop) for s in shards if s.kind == "split"}
        if len(split) > 1:
            raise ValueError(f"{group.name}: experts sliced unevenly {sorted(split)}; the dense experts need one width")
        if group.kind == "experts_w13":  # A (U, dim, 2G, R), B (U, 2G, R, I)
            columns = [2 * g + k for g in held for k in (0, 1)]
            a, b = a[:, :, columns], b[:, columns]
            if split:
                (start, stop), = split
                b = b[..., start:stop]
        else:  # A (U, G, I, R), B (U, G, R, dim)
            a, b = a[:, held], b[:, held]
            if split:
                (start, stop), = split
                a = a[:, :, start:stop]
        return np.ascontiguousarray(a), np.ascontiguousarray(b)
