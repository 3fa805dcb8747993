"""Teacher-forced perplexity of built engines on held-out text, many sequences per decoder step.

Why this exists next to `quantize/scoring.py`: the build's check (`scoring.perplexity`) steps one sequence at a time,
which is what a build can afford for its 128 tokens per domain. Measuring the engines on several times that text
(a test, an evaluation) steps every sequence of every domain as one decoder batch instead, each row under its own
adapter slot: 20 sequences x 256 tokens took 9.6 s against 30.4 s one sequence at a time (fp32 engine, 1 thread,
a loaded 2-core machine), with the same five perplexities to the last digit.
It computes the same figures, not an approximation: a batched decoder step gives every row the bits of its solo
step (the LoRA grid pads to two rows, `export/lora_grid.py`) and each sequence is prefilled alone as `scoring` does,
so the NLL of a row equals `scoring.sequence_nll` of that sequence bit for bit (checked by
`tests/build_engines/quantize/test_quant_engines.py`).

Why here and not in `build_engines/quantize/`: that folder keys the quantized builds' code digest
(`build/manifest.py`), so adding a file there would make every fp8/int8 engine directory stale; this code does not
decide what a build writes.
"""

from __future__ import annotations

import numpy as np

from build_engines.quantize.scoring import Adapters, Arrays, Runner
from ced.steps.layout import StepLayout
from ced.steps.rows import (
    HANDOVER_KEYS,
)
from ced.steps.step_loop import StepLoop


def batched_nll(layout: StepLayout, encoder: Runner, decoder: Runner, bank: Arrays, sequences: list[list[int]],
                slots: list[int]) -> np.ndarray:
    """-log p(token[t+1] | tokens[..t]) for every sequence (all of one length L) under its slot: shape (B, L-1),
    float64. Each sequence is prefilled in one encoder chunk, then all of them step the decoder together."""
    if len({len(s) for s in sequences}) != 1 or len(sequences) != len(slots):
        raise ValueError("batched_nll needs sequences of one length and one slot per sequence")
    ids = np.asarray(sequences, np.int64)
    batch, length = ids.shape
    loop = StepLoop(layout, encoder, decoder, slots, bank)
    handover = [StepLoop.handovers(StepLoop(layout, encoder, decoder, [slot], bank).encode(ids[b:b + 1]), 1)[0]
                for b, slot in enumerate(slots)]  # each sequence's prefill in an encoder step of its own
    nll = np.empty((batch, length - 1))
    for t in range(length - 1):
        result = loop.decode([{k: h[k][t:t + 1] for k in HANDOVER_KEYS} for h in handover])
        logits = result["logits"].astype(np.float64)
        top = logits.max(axis=1)
        nll[:, t] = top + np.log(np.exp(logits - top[:, None]).sum(axis=1)) - logits[np.arange(batch), ids[:, t + 1]]
    return nll


def domain_nll(layout: StepLayout, encoder: Runner, decoder: Runner, adapters: Adapters,
               sequences: dict[str, list[list[int]]]) -> dict[str, np.ndarray]:
    """Per `<kind>/<adapter>` (the build check's keys): the (sequences, L-1) NLL of that kind's text under the
    adapter trained on it (base text under the base model), every kind in one decoder batch."""
    keys, flat, slots = [], [], []
    for kind, seqs in sequences.items():
        slot = adapters.slot_of_kind.get(kind, 0)
        keys += [f"{kind}/{adapters.name_of_slot[slot]}"] * len(seqs)
        flat += seqs
        slots += [slot] * len(seqs)
    nll = batched_nll(layout, encoder, decoder, adapters.bank, flat, slots)
    return {key: nll[[i for i, k in enumerate(keys) if k == key]] for key in dict.fromkeys(keys)}


def perplexities(nll: dict[str, np.ndarray]) -> dict[str, float]:
    """exp(mean NLL) over every predicted token of each key."""
    return {key: float(np.exp(values.mean())) for key, values in nll.items()}
