"""What the arena tests share: one decode step run in two universes of the same sessions, one stacking rows afresh
("plain"), the other through an arena (or an arena pool), with the feeds compared bit for bit before each graph runs."""

from __future__ import annotations

from typing import Any

import numpy as np

from ced.steps.decoder_step import DecoderStep
from ced.steps.encoder_step import EncoderStep
from ced.steps.layout import StepLayout
from ced.steps.lora_stacked import stack_adapters
from ced.steps.parity import torch_runner
from ced.steps.rows import (
    HANDOVER_FIELDS,
    HANDOVER_KEYS,
    DecoderRow,
    EncoderRow,
    Runner,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)

Universe = dict[int, tuple[EncoderRow, DecoderRow]]


def step_runners(net: Any) -> tuple[StepLayout, Runner, Runner, dict[str, np.ndarray]]:
    """The network's layout, its encoder and decoder step modules as graph-like runners, and a base-only adapter
    bank."""
    enc, dec = net.split()
    layout = StepLayout(net.cfg)
    encoder = torch_runner(EncoderStep(enc).eval(), layout.encoder_inputs(), layout.encoder_outputs())
    decoder = torch_runner(DecoderStep(dec).eval(), layout.decoder_inputs(), layout.decoder_outputs())
    return layout, encoder, decoder, stack_adapters(layout, [None])


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, (what, key, a[key].shape, b[key].shape)
        assert np.array_equal(a[key], b[key]), (what, key)


def step_both(layout: StepLayout, encoder: Runner, decoder: Runner, bank: dict[str, np.ndarray], plain: Universe,
              stacked: Universe, active: list[int], tokens: np.ndarray, enc_arena: Any, dec_arena: Any,
              what: str) -> None:
    """One encoder + decoder step of the `active` sessions in both universes (the plain feeds are what runs)."""
    e_plain = encoder_inputs(layout, [plain[s][0] for s in active], tokens)
    e_stacked = encoder_inputs(layout, [stacked[s][0] for s in active], tokens, enc_arena)
    same(e_plain, e_stacked, f"encoder {what}")
    out = encoder(e_plain)
    handovers = []
    for universe in (plain, stacked):
        absorb_encoder(layout, [universe[s][0] for s in active], out, 1)
    for b, s in enumerate(active):
        h = {k: out[k][b] for k in HANDOVER_KEYS}
        plain[s][1].absorb(layout, h)
        stacked[s][1].absorb(layout, h)
        handovers.append({k: h[k] for k in HANDOVER_FIELDS})
    slots = [0] * len(active)
    d_plain = decoder_inputs(layout, [plain[s][1] for s in active], handovers, slots)
    d_stacked = decoder_inputs(layout, [stacked[s][1] for s in active], handovers, slots, dec_arena)
    same(d_plain, d_stacked, f"decoder {what}")
    result = decoder({**d_plain, **bank})
    absorb_decoder([plain[s][1] for s in active], result, d_plain, False, slots)
    absorb_decoder([stacked[s][1] for s in active], result, d_stacked, False, slots)
