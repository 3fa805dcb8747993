"""The step modules (engine form of the network) against the reference network, in PyTorch (fresh random seeds)."""

from __future__ import annotations

import pytest
import torch

from ced.model.primitives import apply_rope_tail, rope_angles
from ced.steps.graph_ops import pair_swap, rope_apply, rope_tables, window_ring_positions
from ced.steps.layout import StepLayout
from tests.build_engines.export.steps_walk import TIE_BOUND, logit_bound, walk_turns
from tests.ced.model.test_engram import engram_network
from tests.tiny import tiny_network


def test_rope_in_gather_form_equals_the_reference_bit_for_bit(seed: int) -> None:
    x = torch.randn(3, 5, 4, 64)
    positions = torch.randint(0, 10_000, (3, 5))
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    cos, sin = rope_angles(positions, inv)
    cos_f, sin_f = rope_tables(positions, inv, 64, 16)
    swap = pair_swap(64, 16)
    for inverse in (False, True):
        want = apply_rope_tail(x, cos.unsqueeze(2), sin.unsqueeze(2), 16, inverse=inverse)
        got = rope_apply(x, cos_f.unsqueeze(2), sin_f.unsqueeze(2), swap, inverse)
        assert torch.equal(got, want)


def test_ring_positions_follow_start_and_ring_start() -> None:
    got = window_ring_positions(torch.tensor([0, 3, 130, 130]), torch.tensor([0, 0, 0, 100]), 128)
    assert (got[0] == -1).all()
    assert got[1, :3].tolist() == [0, 1, 2] and (got[1, 3:] == -1).all()
    assert got[2, 0].item() == 128 and got[2, 1].item() == 129 and got[2, 2].item() == 2
    assert got[3, 0].item() == 128 and got[3, 99].item() == -1 and got[3, 100].item() == 100


@pytest.fixture(params=["plain", "engram"])
def step_net(request, seed):  # type: ignore[no-untyped-def]
    """The tiny network, without and with Engram (layers 1 and 2, the feed's rows gathered from its tables)."""
    return tiny_network() if request.param == "plain" else engram_network()


def test_steps_follow_the_reference_network_through_turns_replays_and_decode(step_net, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Chunked prefill, replay under an adapter, decode, a new turn under another adapter: logits within the derived
    bound of the reference Conversation (steps_walk.logit_bound) up to the first top-k near-tie the reference meets,
    within steps_walk.TIE_BOUND from it on (one entry selected the other way), the same greedy tokens. With Engram the
    encoder step takes rows gathered on the host after each row's n-gram history, across chunks, decode steps and
    turns. `python -m benchmarks seed-sweep` checks the bound over 200 seeds (docs/testing.md)."""
    walk = walk_turns(step_net, tmp_path)
    print(f"max abs logit difference, step modules vs reference: {walk.worst:.2e} ({walk.worst_before_tie:.2e} "
          f"before the first near-tie, step {walk.first_tie})")
    assert walk.other_token is None, walk.other_token
    assert walk.before_tie, "the reference met a near-tie at the first step: nothing was compared within the bound"
    assert walk.worst_before_tie < logit_bound(step_net.cfg)
    assert walk.worst_after_tie < TIE_BOUND
    assert walk.positions_agree
    assert walk.engram_history_agrees in (None, True)


def test_engines_doc_carries_the_current_graph_contract() -> None:
    from ced.formats.checkpoint import load_config
    from ced.formats.drafter_files import drafter_spec
    from ced.routing.pointer_head import load_router_head
    from ced.steps.layout import layout_markdown
    from tests.conftest import EMBEDDED
    from tests.tiny import PROJECT_ROOT

    cfg = load_config(EMBEDDED)
    head, _ = load_router_head(EMBEDDED, cfg.dim)
    doc = (PROJECT_ROOT / "docs" / "engines.md").read_text()
    assert layout_markdown(StepLayout(cfg, drafter_spec(EMBEDDED)), head.cfg.width) in doc, (
        "docs/engines.md is stale: paste layout_markdown() again")


@pytest.mark.parametrize("trial", range(5))
def test_pooled_selection_equals_masking_every_stored_entry(trial: int) -> None:
    """The decoder's re-index layers score only the candidate pool; the entries they pick (ties included: many scores
    are exactly equal) must be the ones the reference picks by scoring every entry and masking all but the pool."""
    from ced.model.attention import candidate_entry_mask
    from ced.model.attention import select_top as reference_select_top
    from ced.steps.common import candidate_pool_ids

    g = torch.Generator().manual_seed(trial)
    B, S, N, block, C, k = 2, 6, 96, 8, 4, 10
    scores = torch.randint(0, 3, (B, S, N), generator=g).float()  # few distinct values: ties everywhere
    positions = torch.randint(0, N, (B, S), generator=g)
    candidates = torch.stack([torch.randperm(N // block, generator=g)[:C] for _ in range(B * S)]).view(B, S, C)
    candidates[0, 0, 1:] = -1  # a short pool
    entries = torch.arange(N).view(1, 1, N)
    keep = candidate_entry_mask(candidates, N, block) & (entries < (positions + 1).unsqueeze(-1))
    want = reference_select_top(torch.where(keep, scores, torch.tensor(float("-inf"))), k)

    ids = candidate_pool_ids(candidates, block)
    pool_scores = torch.gather(scores, -1, ids.clamp(min=0))
    pool_keep = (ids >= 0) & (ids < (positions + 1).unsqueeze(-1))
    picked = reference_select_top(torch.where(pool_keep, pool_scores, torch.tensor(float("-inf"))), k)
    got = torch.where(picked < 0, picked, torch.gather(ids, -1, picked.clamp(min=0)))
    assert torch.equal(got, want)
    assert (want[0, 0] >= 0).sum() <= block  # the short pool really was short
