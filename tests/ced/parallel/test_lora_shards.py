"""Each rank's cut of the stacked LoRA bank computes exactly its part of every adapter product: the rank's output
slice of a column-parallel projection, a partial sum of a row-parallel one (the ranks' partials add up to the whole
product), and whole products of the experts it owns. Checked numerically on random banks for every group kind."""

from __future__ import annotations

import numpy as np
import pytest

from ced.parallel import ParallelLayout, sharding_plan
from ced.steps.layout import StepLayout
from ced.steps.lora_shards import LoraShards
from tests.ced.parallel.test_parallel_network import parallel_config

SLOTS, RANK, ROWS = 2, 4, 3


def _bank(layout: StepLayout, rng: np.random.Generator) -> dict[str, np.ndarray]:
    bank = {}
    for g in layout.lora_groups():
        a, b = layout.lora_shapes(g, SLOTS, RANK)
        bank[f"lora_a.{g.name}"], bank[f"lora_b.{g.name}"] = rng.standard_normal(a), rng.standard_normal(b)
    return bank


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_the_ranks_cuts_compute_the_whole_adapter_products(expert_parallel: bool) -> None:
    cfg, N = parallel_config(), 2
    step_layout = StepLayout(cfg)
    bank = _bank(step_layout, np.random.default_rng(0))
    layouts = [ParallelLayout(N, r, expert_parallel) for r in range(N)]
    cuts = [LoraShards(cfg, lay).cut(bank) for lay in layouts]
    plans = [sharding_plan(cfg, lay) for lay in layouts]
    rng = np.random.default_rng(1)
    seen = set()
    for g in step_layout.lora_groups():
        a, b = bank[f"lora_a.{g.name}"], bank[f"lora_b.{g.name}"]
        parts = [(c[f"lora_a.{g.name}"], c[f"lora_b.{g.name}"]) for c in cuts]
        if g.kind == "linear":
            x = rng.standard_normal((SLOTS, ROWS, g.in_features))
            whole = x @ a @ b
            shards = [plan[f"{g.modules[0]}.weight"][0] for plan in plans]
            seen.add(shards[0].kind if shards[0].kind != "split" else f"split{shards[0].dim}")
            if shards[0].kind == "split" and shards[0].dim == 0:  # column parallel: each rank its output columns
                got = np.concatenate([x @ pa @ pb for pa, pb in parts], -1)
            elif shards[0].kind == "split":  # row parallel: each rank its input columns, partials summed
                got = sum(x[..., s.start:s.stop] @ pa @ pb for s, (pa, pb) in zip(shards, parts))
            else:  # replicated: the whole product on every rank
                assert all(np.array_equal(pa, a) and np.array_equal(pb, b) for pa, pb in parts)
                got = whole
            np.testing.assert_allclose(got, whole, rtol=1e-10, atol=1e-10)
            continue
        experts = [m.rsplit(".", 1)[0] for m in g.modules[:: 2 if g.kind == "experts_w13" else 1]]
        weight = "w1" if g.kind == "experts_w13" else "w2"
        held = [[e for e, name in enumerate(experts) if plan[f"{name}.{weight}.weight"][0].held] for plan in plans]
        if expert_parallel:  # every expert on exactly one rank, whole
            assert sorted(e for h in held for e in h) == list(range(len(experts)))
            for h, (pa, pb) in zip(held, parts):
                if g.kind == "experts_w13":
                    columns = [2 * e + k for e in h for k in (0, 1)]
                    assert np.array_equal(pa, a[:, :, columns]) and np.array_equal(pb, b[:, columns])
                else:
                    assert np.array_equal(pa, a[:, h]) and np.array_equal(pb, b[:, h])
            continue
        assert all(h == list(range(len(experts))) for h in held)  # tensor parallel: a slice of every expert
        for e in range(len(experts)):
            if g.kind == "experts_w13":  # column parallel per expert: each rank its intermediate columns
                x = rng.standard_normal((SLOTS, ROWS, g.in_features))
                for k in (0, 1):
                    whole = x @ a[:, :, 2 * e + k] @ b[:, 2 * e + k]
                    got = np.concatenate([x @ pa[:, :, 2 * e + k] @ pb[:, 2 * e + k] for pa, pb in parts], -1)
                    np.testing.assert_allclose(got, whole, rtol=1e-10, atol=1e-10)
            else:  # row parallel per expert: each rank its intermediate rows, partials summed
                x = rng.standard_normal((SLOTS, ROWS, g.in_features))
                shards = [plan[f"{experts[e]}.w2.weight"][0] for plan in plans]
                whole = x @ a[:, e] @ b[:, e]
                got = sum(x[..., s.start:s.stop] @ pa[:, e] @ pb[:, e] for s, (pa, pb) in zip(shards, parts))
                np.testing.assert_allclose(got, whole, rtol=1e-10, atol=1e-10)
    assert {"split0", "split1", "replicated"} <= seen, "column, row and replicated projections all checked"
