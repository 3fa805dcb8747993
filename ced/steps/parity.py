"""Run a step module and its exported graph on the same real inputs and measure how far apart they are.

Used by the build (a graph that drifts from its module is not written) and by the parity tests. The inputs are a
real short sequence: a prefill chunk through the encoder, the decoder's bounded replay under two different adapter
slots in one batch, and the pointer on random H19 against a small option set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ced.steps.layout import GraphTensor, StepLayout
from ced.steps.rows import (
    HANDOVER_KEYS,
    DecoderRow,
    EncoderRow,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)

if TYPE_CHECKING:
    from ced.steps.engram_feed import EngramFeed

HANDOVER = HANDOVER_KEYS
Runner = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def torch_runner(module: torch.nn.Module, inputs: list[GraphTensor], outputs: list[GraphTensor]) -> Runner:
    @torch.no_grad()
    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = module(*[torch.from_numpy(np.ascontiguousarray(feed[t.name])) for t in inputs])
        result = result if isinstance(result, tuple) else (result,)
        return {t.name: r.numpy() for t, r in zip(outputs, result)}

    return run


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    """Per output: max abs difference (floats), or 0/1 mismatch for integer outputs (indices must be equal)."""
    out = {}
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape:
            out[name] = float("inf")
        elif x.dtype.kind in "iub":
            out[name] = float(not np.array_equal(x, y))
        else:
            out[name] = float(np.abs(x.astype(np.float64) - y).max()) if x.size else 0.0
    return out


def sample_sequence(layout: StepLayout, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, layout.cfg.vocab_size, (1, length), dtype=np.int64)


def encoder_case(layout: StepLayout, encoder: Runner, lengths: tuple[int, int], seed: int,
                 engram: "EngramFeed | None" = None) -> dict[str, np.ndarray]:
    """Encoder inputs of a second chunk, after a first chunk encoded by `encoder` (so the rings, the stores, the
    Engram history and, with an odd first length, the compressor's unpaired token are all in use)."""
    row = EncoderRow.empty(layout)
    first = sample_sequence(layout, lengths[0], seed)
    absorb_encoder(layout, [row], encoder(encoder_inputs(layout, [row], first, engram=engram)), lengths[0], first)
    return encoder_inputs(layout, [row], sample_sequence(layout, lengths[1], seed + 1), engram=engram)


def decoder_case(layout: StepLayout, encoder: Runner, length: int, seed: int, slots: list[int],
                 engram: "EngramFeed | None" = None) -> dict[str, np.ndarray]:
    """A bounded replay of `len(slots)` sessions (each `length` tokens, encoded by `encoder`) under the given slots."""
    rows = []
    for i, _ in enumerate(slots):
        erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
        tokens = sample_sequence(layout, length, seed + i)
        out = encoder(encoder_inputs(layout, [erow], tokens, engram=engram))
        absorb_encoder(layout, [erow], out, length, tokens)
        drow.absorb(layout, {k: out[k][0] for k in HANDOVER})
        rows.append(drow)
    return decoder_inputs(layout, rows, None, slots)
