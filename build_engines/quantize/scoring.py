"""Teacher-forced scoring through engine graphs: per-token negative log-likelihood of held-out text.

Why through the step graphs and not the reference network: the point is to measure what a quantized *engine*
computes, with the serving path's state handling (`export/rows.py`). The encoder prefills the sequence in one
chunk (chunking changes no bit); the decoder then steps one hand-over row at a time, so every position gets its
next-token logits, under one adapter slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ced.steps.layout import StepLayout
from ced.steps.step_loop import StepLoop

Arrays = dict[str, np.ndarray]
Runner = Callable[[Arrays], Arrays]


@dataclass
class Adapters:
    """The bundled adapters stacked as the decoder's bank (slot 0 = base) and the slot of each domain kind."""

    bank: Arrays
    slot_of_kind: dict[str, int]
    name_of_slot: dict[int, str]


def bundled_adapters(model_dir: Path, layout: StepLayout) -> Adapters:
    """Every adapter under `<model>/adapters/` (folder `L<n>_<kind>`) in one bank; base text uses slot 0."""
    from ced.formats.checkpoint import load_checkpoint
    from ced.lora.bank import AdapterBank
    from ced.steps.lora_stacked import stack_adapters

    net = load_checkpoint(model_dir)
    loaded = AdapterBank(net.cfg, net).load_bundled(model_dir)
    names = sorted(loaded)
    bank = stack_adapters(layout, [None] + [loaded[n] for n in names])
    slot_of_kind = {"base": 0, **{n.split("_", 1)[-1]: i + 1 for i, n in enumerate(names)}}
    return Adapters(bank, slot_of_kind, {0: "base", **{i + 1: n for i, n in enumerate(names)}})


def sequence_nll(layout: StepLayout, encoder: Runner, decoder: Runner, bank: Arrays, tokens: list[int],
                 slot: int) -> np.ndarray:
    """-log p(token[t+1] | tokens[..t]) for t = 0..L-2, under adapter `slot` (float64)."""
    ids = np.asarray(tokens, np.int64)[None]
    loop = StepLoop(layout, encoder, decoder, [slot], bank)
    (handover,) = StepLoop.handovers(loop.encode(ids), 1)
    nll = np.empty(ids.shape[1] - 1)
    for t in range(ids.shape[1] - 1):
        logits = loop.decode([{k: v[t:t + 1] for k, v in handover.items()}])["logits"][0].astype(np.float64)
        top = logits.max()
        nll[t] = top + np.log(np.exp(logits - top).sum()) - logits[ids[0, t + 1]]
    return nll


def perplexity(layout: StepLayout, encoder: Runner, decoder: Runner, bank: Arrays, sequences: list[list[int]],
               slot: int) -> float:
    """exp(mean NLL) over every predicted token of the sequences."""
    nll = np.concatenate([sequence_nll(layout, encoder, decoder, bank, s, slot) for s in sequences])
    return float(np.exp(nll.mean()))
