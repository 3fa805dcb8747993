"""The parallel-layout plan's arithmetic: the roles partition the release's weights, each layout's shares add up, and
layouts that do not divide the model are refused."""

from __future__ import annotations

import pytest

from build_engines.verify.parallel_plan import Layout, _model_bytes, plan_markdown, role_plans
from ced.model.config import get_preset

pytestmark = pytest.mark.slow  # the release-sized meta network takes ~10-30 s to build


def test_one_gpu_per_role_holds_exactly_the_release_weights_split_by_role() -> None:
    cfg = get_preset("deepseek-v4.1-flash")
    plans = role_plans(cfg, 1, (Layout("one", 1, 1, 1),))
    assert {p.role for p in plans} == {"encoder", "decoder"}
    assert sum(p.weights_per_gpu for p in plans) == pytest.approx(_model_bytes(cfg)[0].weight_bytes_release)
    assert all(p.collective_bytes(131072) == 0 for p in plans)
    enc, dec = plans
    assert 0.45 < enc.weights_per_gpu / (enc.weights_per_gpu + dec.weights_per_gpu) < 0.55  # experts sit in both halves


def test_sharding_divides_what_it_splits_and_data_parallel_attention_multiplies_sessions() -> None:
    cfg = get_preset("deepseek-v4.1-flash")
    one = {p.role: p for p in role_plans(cfg, 1, (Layout("one", 1, 1, 1),))}
    plans = role_plans(cfg, 8)
    for p in plans:
        total = one[p.role].weights_per_gpu
        assert total / 8 < p.weights_per_gpu < total / 8 * 1.3  # only the small replicated tensors are held 8 times
    tp8, ep8 = (next(p for p in plans if p.layout.name.startswith(n) and p.role == "decoder") for n in ("TP8", "EP8"))
    # TP replicates the single KV latent on every rank; data-parallel attention keeps each session on one GPU
    per_byte = ep8.sessions(32768, 8) / ep8.free_per_gpu / (tp8.sessions(32768, 8) / tp8.free_per_gpu)
    assert 7.9 < per_byte < 8.1
    assert tp8.collective_bytes(32768) < ep8.collective_bytes(32768) and ep8.index_score_bytes_per_context_token == 0
    assert "| TP8 | decoder |" in plan_markdown(cfg, 8)


def test_a_layout_that_does_not_divide_the_model_is_refused() -> None:
    cfg = get_preset("deepseek-v4.1-flash")
    with pytest.raises(ValueError, match="routed experts"):
        role_plans(cfg, 7, (Layout("EP7", 1, 7, 1),))
    with pytest.raises(ValueError, match="expert_ep x expert_tp"):
        role_plans(cfg, 8, (Layout("bad", 8, 2, 2),))
