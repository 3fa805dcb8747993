"""DSpark in the engines: the decoder step's `draft_main` rows are the drafter's `main_x` of the reference network's
target layers, and the drafter step drafts what the reference `DSpark.forward` drafts, row by row, in a batch whose
rows have different ring fills and positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ced.model.dspark import DSpark, DSparkSpec
from ced.model.network import DecoderEngine, EncoderEngine, init_weights
from ced.steps.decoder_step import DecoderStep
from ced.steps.draft_step import DraftMain, DraftStep
from ced.steps.encoder_step import EncoderStep
from ced.steps.layout import StepLayout
from ced.steps.parity import decoder_case, sample_sequence, torch_runner
from tests.tiny import tiny_config, tiny_network


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    cfg = tiny_config()
    torch.manual_seed(1)
    net = tiny_network(cfg)
    torch.manual_seed(0)
    drafter = DSpark(cfg, DSparkSpec.scaled(cfg))
    init_weights(drafter)
    return cfg, net.eval(), drafter.eval()


def test_the_drafter_step_drafts_what_the_reference_drafts_for_every_row_of_a_batch(tiny) -> None:  # type: ignore[no-untyped-def]
    cfg, net, drafter = tiny
    W = cfg.window_size
    tokens = torch.randint(0, cfg.vocab_size, (3, W + 20), generator=torch.Generator().manual_seed(5))
    lengths = [W + 20, 1, W // 2]  # a full window (rows beyond it dropped), a single row, half a window
    step = DraftStep(drafter, net.embed, net.head).eval()
    main = DraftMain(drafter)
    ring = torch.zeros(3, W, cfg.dim)
    want_tokens, want_confidence = [], []
    with torch.no_grad():
        hidden = net(tokens, targets=drafter.spec.target_layers).target_hidden
        last = tokens[:, 7]
        for b, T in enumerate(lengths):
            ref = drafter(hidden[b:b + 1, :T], last[b:b + 1], net.embed, net.head)
            want_tokens.append(ref.tokens[0])
            want_confidence.append(ref.confidence[0])
            keep = min(T, W)
            ring[b, :keep] = main(hidden[b:b + 1, T - keep:T])[0]
        counts = torch.tensor([min(T, W) for T in lengths])
        got_tokens, got_confidence = step(ring, counts, torch.tensor(lengths) - 1, last)
    assert torch.equal(got_tokens, torch.stack(want_tokens))
    assert torch.allclose(got_confidence, torch.stack(want_confidence), atol=1e-5)
    # padding beyond a row's count is never read: garbage there changes nothing
    with torch.no_grad():
        noisy = ring.clone()
        noisy[1, 1:] = 1e3
        again = step(noisy, counts, torch.tensor(lengths) - 1, last)
    assert torch.equal(again[0], got_tokens) and torch.equal(again[1], got_confidence)


def test_the_decoder_step_returns_the_drafters_main_rows_of_the_target_layers(tiny) -> None:  # type: ignore[no-untyped-def]
    """A bounded replay through the decoder step: its `draft_main` rows equal `main_x` of the reference network's
    target-layer inputs over the same tokens (the base model, slot 0)."""
    cfg, net, drafter = tiny
    layout = StepLayout(cfg, drafter.spec)
    state = net.state_dict()
    encoder = torch_runner(EncoderStep(EncoderEngine.from_state_dict(cfg, state).eval()).eval(),
                           layout.encoder_inputs(), layout.encoder_outputs())
    decoder = DecoderStep(DecoderEngine.from_state_dict(cfg, state).eval(), DraftMain(drafter)).eval()
    length = 20
    feed = decoder_case(layout, encoder, length, seed=3, slots=[0])
    from build_engines.build.onnx_build import random_bank

    feed |= random_bank(layout, slots=1, rank=4)
    out = torch_runner(decoder, layout.decoder_inputs(), layout.decoder_outputs())(feed)
    tokens = torch.from_numpy(sample_sequence(layout, length, 3))
    with torch.no_grad():
        want = drafter.main_x(net(tokens, targets=drafter.spec.target_layers).target_hidden)[0]
    got = out["draft_main"][0, -length:]
    assert got.shape == (length, cfg.dim)
    assert np.abs(got - want.numpy()).max() < 1e-4


def test_target_layers_the_decoder_does_not_see_are_refused(tiny) -> None:  # type: ignore[no-untyped-def]
    cfg, net, _ = tiny
    spec = DSparkSpec.scaled(cfg)
    early = DSpark(cfg, DSparkSpec(**{**spec.__dict__, "target_layers": (cfg.first_decoder_layer, cfg.n_layers - 1)}))
    with pytest.raises(ValueError, match="must lie after layer"):
        DecoderStep(DecoderEngine.from_state_dict(cfg, net.state_dict()).eval(), DraftMain(early))
