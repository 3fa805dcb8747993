"""The step modules (engine form of the network) against the reference network, in PyTorch (fresh random seeds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ced.conversation import Conversation
from ced.lora import AdapterBank, decoder_lora_modules, random_adapter_weights, save_adapter
from ced.model.primitives import apply_rope_tail, rope_angles
from ced.steps.decoder_step import DecoderStep
from ced.steps.encoder_step import EncoderStep
from ced.steps.engram_feed import EngramFeed
from ced.steps.graph_ops import pair_swap, rope_apply, rope_tables, window_ring_positions
from ced.steps.layout import StepLayout
from ced.steps.lora_stacked import stack_adapters
from ced.steps.parity import HANDOVER, torch_runner
from ced.steps.rows import (
    DecoderRow,
    EncoderRow,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)
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


@pytest.fixture
def steps(step_net, tmp_path):  # type: ignore[no-untyped-def]
    net = step_net
    cfg = net.cfg
    enc, dec = net.split()
    bank = AdapterBank(cfg, dec)
    adapters = []
    for name in ("A", "B"):
        save_adapter(tmp_path / name, random_adapter_weights(decoder_lora_modules(cfg, dec), 4, 0.05), 4, 8.0, "tiny")
        adapters.append(bank.load(tmp_path / name, name=name))
    bank.attach(dec)
    layout = StepLayout(cfg)
    encoder = torch_runner(EncoderStep(enc).eval(), layout.encoder_inputs(), layout.encoder_outputs())
    decoder = torch_runner(DecoderStep(dec).eval(), layout.decoder_inputs(), layout.decoder_outputs())
    lora = stack_adapters(layout, [None, *adapters])
    return layout, enc, dec, encoder, decoder, lora, adapters, EngramFeed.of_network(layout, enc)


def test_steps_follow_the_reference_network_through_turns_replays_and_decode(steps) -> None:  # type: ignore[no-untyped-def]
    """Chunked prefill, replay under an adapter, decode, a new turn under another adapter: logits within 1e-4 of the
    reference Conversation, the same greedy tokens, the same top-k selections. With Engram the encoder step takes
    rows gathered on the host after each row's n-gram history, across chunks, decode steps and turns."""
    layout, enc, dec, encoder, decoder, lora, adapters, engram = steps
    cfg = layout.cfg
    conv = Conversation(enc, dec)
    erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
    worst = 0.0
    for turn, (length, slot) in enumerate([(37, 1), (173, 2), (41, 0), (9, 1)]):  # the first replay is shorter than W
        tokens = torch.randint(0, cfg.vocab_size, (1, length))
        want = conv.new_turn(tokens, [None, *adapters][slot])
        for chunk in torch.split(tokens, 64, dim=1):  # prefill in chunks, as the encoder service does
            out = encoder(encoder_inputs(layout, [erow], chunk.numpy(), engram=engram))
            absorb_encoder(layout, [erow], out, chunk.shape[1], chunk.numpy())
            drow.absorb(layout, {k: out[k][0] for k in HANDOVER})
        feed = {**decoder_inputs(layout, [drow], None, [slot]), **lora}
        got = decoder(feed)
        absorb_decoder([drow], got, feed, True, [slot])
        worst = max(worst, float(np.abs(got["logits"][0] - want.logits[0, -1].numpy()).max()))
        token = int(want.logits[0, -1].argmax())
        assert int(got["logits"][0].argmax()) == token, f"turn {turn}: replay picks another token"
        for _ in range(6):
            want = conv.step(torch.tensor([[token]]))
            out = encoder(encoder_inputs(layout, [erow], np.array([[token]]), engram=engram))
            absorb_encoder(layout, [erow], out, 1, np.array([[token]]))
            rows = {k: out[k][0] for k in HANDOVER}
            drow.absorb(layout, rows)
            feed = {**decoder_inputs(layout, [drow], [{k: rows[k] for k in HANDOVER[:4]}], [slot]), **lora}
            got = decoder(feed)
            absorb_decoder([drow], got, feed, False, [slot])
            worst = max(worst, float(np.abs(got["logits"][0] - want.logits[0, -1].numpy()).max()))
            token = int(want.logits[0, -1].argmax())
            assert int(got["logits"][0].argmax()) == token
    print(f"max abs logit difference, step modules vs reference: {worst:.2e}")
    assert worst < 1e-4
    assert erow.position == drow.position == conv.position
    if engram is not None:
        history = conv.encoder_state.engram_history[0]  # compressed ids; the row keeps the raw ones
        assert torch.equal(engram.hasher.compress(torch.from_numpy(erow.engram_recent)), history)


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
