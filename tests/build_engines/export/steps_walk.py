"""The step modules walked through a conversation beside the reference network, and the bound their logits keep.

Shared by test_steps.py (one fixed seed per variant), test_fake_quant_steps.py (the same walk with the runtime
fake-quant on) and `python -m benchmarks seed-sweep` (the bound checked over hundreds of seeds, docs/testing.md).

Why the bound has two terms. The step modules compute what the reference computes in another order (chunked
prefill, gathered ring rows, the LoRA grid), so float32 rounding differs at the level of a few units in the last
place of each product; through the tiny network that stays below `ROUNDING_BOUND` on the logits. The Engram gate
is the exception: gate = sigmoid(copysign(sqrt(max(|dot|, GATE_FLOOR)), dot)) is discontinuous at dot = 0, so a
rounding difference that moves a dot across zero moves the signed root by up to 2 * sqrt(GATE_FLOOR) and the gate
by up to sigmoid'(0) * 2 * sqrt(GATE_FLOOR) = 5e-4 (a "tie" the two paths may break either way). That gate
multiplies a value row and the layers after it carry the step to the logits; `GATE_GAIN` allows a factor 4 for
both, so the Engram term is 4 * 5e-4 = 2e-3. Neither term depends on the seed; the sweep shows how much of each a
run uses.

Where the rounding bound cannot hold: a top-k selection (the indexer's entries, layer 20's candidate blocks, the MoE
gate's experts) whose k-th and (k+1)-th scores differ by less than rounding can. The two paths may then select
different entries, a discontinuity of the size of one entry's contribution, and every step after it carries the
changed state. The walk records where the reference first met such a near-tie (`NearTies`: a gap above 0 and within
`TIE_MARGIN` of the row's largest score); the rounding bound applies to the steps before it, and `TIE_BOUND` to the
steps from it on. The 200-seed sweeps (docs/testing.md) set both: the walks that crossed the rounding bound had met a
near-tie with a gap of at most 1.8e-7 of the row's largest score (TIE_MARGIN leaves 5x), and the largest difference
any walk showed after one was 6.4e-3 (TIE_BOUND leaves 8x); a bug that moves the computation moves the logits by
tenths.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import numpy as np
import torch

import ced.model.attention as attention
from ced.conversation import Conversation
from ced.lora import AdapterBank, decoder_lora_modules, random_adapter_weights, save_adapter
from ced.model.config import CEDConfig
from ced.model.engram import GATE_FLOOR
from ced.model.network import CEDNetwork
from ced.steps.decoder_step import DecoderStep
from ced.steps.encoder_step import EncoderStep
from ced.steps.engram_feed import EngramFeed
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

ROUNDING_BOUND = 1e-4  # reordered float32 arithmetic, no discontinuity crossed
SIGMOID_SLOPE_AT_0 = 0.25
GATE_GAIN = 4.0  # the value row the gate scales, and the layers from there to the logits
TURNS = [(37, 1), (173, 2), (41, 0), (9, 1)]  # (length, adapter slot); the first replay is shorter than the window
DECODE_STEPS = 6
TIE_MARGIN = 1e-6  # a top-k cut this close (relative to the row's largest score) is within the two paths' rounding
TIE_BOUND = 5e-2  # the logits after a near-tie: one entry selected differently, carried by the steps after it


def logit_bound(cfg: CEDConfig) -> float:
    """The largest logit difference the step modules may show against the reference (module docstring)."""
    if not cfg.engram_layers:
        return ROUNDING_BOUND
    return ROUNDING_BOUND + GATE_GAIN * SIGMOID_SLOPE_AT_0 * 2 * GATE_FLOOR**0.5


class NearTies:
    """Counts, while `watching`, the reference's top-k cuts whose k-th and (k+1)-th scores differ by more than 0 and
    at most TIE_MARGIN x the row's largest finite |score|. Exact ties are not counted: both paths break them by the
    lower index (attention.select_top's stable sort)."""

    def __init__(self) -> None:
        self.count = 0

    def note(self, scores: torch.Tensor, k: int) -> None:
        if scores.shape[-1] <= k:
            return
        ordered = scores.detach().float().sort(dim=-1, descending=True).values
        kth, next_ = ordered[..., k - 1], ordered[..., k]
        finite = torch.where(torch.isfinite(ordered), ordered.abs(), torch.zeros_like(ordered))
        scale = finite.amax(-1)
        gap = kth - next_
        near = torch.isfinite(kth) & torch.isfinite(next_) & (gap > 0) & (gap <= TIE_MARGIN * scale)
        self.count += int(near.sum())

    @contextmanager
    def watching(self) -> Iterator[None]:
        """The reference's selections go through attention.select_top (indexer and candidate blocks) and torch.topk
        (the MoE gate); both are wrapped while the reference alone runs."""
        select_top, topk = attention.select_top, torch.topk

        def noted_select_top(scores: torch.Tensor, k: int) -> torch.Tensor:
            self.note(scores, k)
            return select_top(scores, k)

        def noted_topk(scores: torch.Tensor, k: int, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            dim = int(kwargs.get("dim", args[0] if args else -1))  # type: ignore[call-overload]
            self.note(scores.movedim(dim, -1), k)
            return topk(scores, k, *args, **kwargs)

        with patch.object(attention, "select_top", noted_select_top), patch.object(torch, "topk", noted_topk):
            yield


@dataclass
class Walk:
    differences: list[float]  # max abs logit difference at each replay and decode step, in order
    other_token: str | None  # where the step modules' greedy token first differs from the reference's, if anywhere
    odd_ends: int  # encoder steps that ended on an odd position (each leaves a ratio-2 source's last token unpaired)
    positions_agree: bool
    engram_history_agrees: bool | None  # None without Engram
    first_tie: int | None = None  # the first step whose reference computation met a near-tie (NearTies), if any

    @property
    def worst(self) -> float:
        return max(self.differences)

    @property
    def before_tie(self) -> list[float]:
        """The differences the bound applies to: every step before the first near-tie (all of them without one)."""
        return self.differences if self.first_tie is None else self.differences[:self.first_tie]

    @property
    def worst_before_tie(self) -> float:
        return max(self.before_tie, default=0.0)

    @property
    def worst_after_tie(self) -> float:
        """The largest difference from the first near-tie on (0 without one): what TIE_BOUND applies to."""
        return 0.0 if self.first_tie is None else max(self.differences[self.first_tie:], default=0.0)


def walk_turns(net: CEDNetwork, work: Path, turns: list[tuple[int, int]] = TURNS,
               decode_steps: int = DECODE_STEPS) -> Walk:
    """Chunked prefill, replay under an adapter, `decode_steps` decode steps, a new turn under another adapter
    (`turns`: length and adapter slot of each), with two random adapters saved under `work`: the step modules beside
    the reference Conversation, fed the reference's tokens."""
    cfg = net.cfg
    enc, dec = net.split()
    bank = AdapterBank(cfg, dec)
    adapters = []
    for name in ("A", "B"):
        save_adapter(work / name, random_adapter_weights(decoder_lora_modules(cfg, dec), 4, 0.05), 4, 8.0, "tiny")
        adapters.append(bank.load(work / name, name=name))
    bank.attach(dec)
    layout = StepLayout(cfg)
    encoder = torch_runner(EncoderStep(enc).eval(), layout.encoder_inputs(), layout.encoder_outputs())
    decoder = torch_runner(DecoderStep(dec).eval(), layout.decoder_inputs(), layout.decoder_outputs())
    lora = stack_adapters(layout, [None, *adapters])
    engram = EngramFeed.of_network(layout, enc)

    conv = Conversation(enc, dec)
    erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
    differences: list[float] = []
    other, odd_ends = None, 0
    ties, first_tie = NearTies(), None

    def reference(call, *args):  # type: ignore[no-untyped-def]
        """One reference computation, watched for near-ties; the step it computes is the next one compared."""
        nonlocal first_tie
        before = ties.count
        with ties.watching():
            result = call(*args)
        if first_tie is None and ties.count > before:
            first_tie = len(differences)
        return result

    def compare(got: dict[str, np.ndarray], want: torch.Tensor, where: str) -> int:
        nonlocal other
        differences.append(float(np.abs(got["logits"][0] - want.numpy()).max()))
        token = int(want.argmax())
        if other is None and int(got["logits"][0].argmax()) != token:
            other = where
        return token

    for turn, (length, slot) in enumerate(turns):
        tokens = torch.randint(0, cfg.vocab_size, (1, length))
        want = reference(conv.new_turn, tokens, [None, *adapters][slot])
        for chunk in torch.split(tokens, 64, dim=1):  # prefill in chunks, as the encoder service does
            out = encoder(encoder_inputs(layout, [erow], chunk.numpy(), engram=engram))
            absorb_encoder(layout, [erow], out, chunk.shape[1], chunk.numpy())
            odd_ends += erow.position % 2
            drow.absorb(layout, {k: out[k][0] for k in HANDOVER})
        feed = {**decoder_inputs(layout, [drow], None, [slot]), **lora}
        got = decoder(feed)
        absorb_decoder([drow], got, feed, True, [slot])
        token = compare(got, want.logits[0, -1], f"turn {turn}: replay")
        for step in range(decode_steps):
            want = reference(conv.step, torch.tensor([[token]]))
            out = encoder(encoder_inputs(layout, [erow], np.array([[token]]), engram=engram))
            absorb_encoder(layout, [erow], out, 1, np.array([[token]]))
            odd_ends += erow.position % 2
            rows = {k: out[k][0] for k in HANDOVER}
            drow.absorb(layout, rows)
            feed = {**decoder_inputs(layout, [drow], [{k: rows[k] for k in HANDOVER[:4]}], [slot]), **lora}
            got = decoder(feed)
            absorb_decoder([drow], got, feed, False, [slot])
            token = compare(got, want.logits[0, -1], f"turn {turn}: decode step {step}")
    history = None
    if engram is not None:
        want_history = conv.encoder_state.engram_history[0]  # compressed ids; the row keeps the raw ones
        history = bool(torch.equal(engram.hasher.compress(torch.from_numpy(erow.engram_recent)), want_history))
    return Walk(differences, other, odd_ends, erow.position == drow.position == conv.position, history,
                first_tie)
