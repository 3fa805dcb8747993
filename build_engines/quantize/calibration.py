"""Calibration feeds for ModelOpt PTQ: held-out (`val`) text pushed through the fp32 engines as the server runs them.

Each held-out sequence gives encoder feeds (a prefill chunk, then a second chunk on the first one's state) and
decoder feeds (a bounded replay of the last W rows under the adapter of the text's domain, then single-row decode
steps), so activations are calibrated over the shapes and states serving produces. The adapter bank is the same for
every decoder feed and is written once (`decoder_shared.npz`); the LoRA products themselves are not quantized.
The same run records the largest magnitude of every state tensor the steps write (`StateAmax`): the per-tensor
scales of an fp8 KV build (`kv_cache.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from build_engines.quantize.heldout import HeldoutText, token_sequences
from build_engines.quantize.kv_cache import StateAmax
from build_engines.quantize.scoring import Adapters, Runner
from ced.steps.layout import StepLayout
from ced.steps.rows import (
    HANDOVER_KEYS,
)
from ced.steps.step_loop import StepLoop

SEQUENCE_TOKENS = 256  # per calibration sequence: two window lengths, so replays see a full window
SEQUENCES_PER_KIND = 4
FIRST_CHUNK = 192
DECODE_STEPS = 2


@dataclass
class CalibrationSet:
    directory: Path
    encoder_feeds: int
    decoder_feeds: int
    sequences: int
    tokens: int
    amax: StateAmax

    def describe(self) -> dict[str, int]:
        return {"sequences": self.sequences, "tokens": self.tokens, "encoder_feeds": self.encoder_feeds,
                "decoder_feeds": self.decoder_feeds, "sequence_tokens": SEQUENCE_TOKENS}


def write_calibration(out: Path, layout: StepLayout, encoder: Runner, decoder: Runner, heldout: HeldoutText,
                      tokenizer: Path, adapters: Adapters) -> CalibrationSet:
    """Write `encoder_NNN.npz`, `decoder_NNN.npz` and `decoder_shared.npz` (the bank) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    sequences = token_sequences(heldout, tokenizer, SEQUENCE_TOKENS, SEQUENCES_PER_KIND)
    np.savez(out / "decoder_shared.npz", **adapters.bank)
    counts = {"encoder": 0, "decoder": 0}
    amax = StateAmax.empty(layout)

    def save(kind: str, feed: dict[str, np.ndarray]) -> None:
        np.savez(out / f"{kind}_{counts[kind]:03d}.npz", **feed)
        counts[kind] += 1

    jobs = [(kind, seq) for kind, seqs in sequences.items() for seq in seqs]
    for kind, seq in tqdm(jobs, desc="calibration feeds", unit="seq", leave=False):
        ids = np.asarray(seq, np.int64)[None]
        slot = adapters.slot_of_kind.get(kind, 0)

        def observe(step: str, feed: dict[str, np.ndarray], result: dict[str, np.ndarray]) -> None:
            if step == "encoder":  # before the row absorbs the step: its position is still the step's start
                save("encoder", feed)
                amax.encoder(layout, result, [loop.erows[0].position], feed["tokens"].shape[1])
            else:
                save("decoder", feed)
                amax.decoder(result, [loop.drows[0].replay_count] if step == "replay" else [1])

        loop = StepLoop(layout, encoder, decoder, [slot], adapters.bank, observe=observe)
        outs = [loop.encode(ids[:, lo:hi]) for lo, hi in ((0, FIRST_CHUNK), (FIRST_CHUNK, ids.shape[1]))]
        handover = {k: np.concatenate([o[k][0] for o in outs]) for k in HANDOVER_KEYS}
        n = ids.shape[1] - DECODE_STEPS
        loop.hand_over([{k: v[:n] for k, v in handover.items()}])
        loop.replay()  # then decode steps on real rings
        for t in range(n, ids.shape[1]):
            loop.decode([{k: v[t:t + 1] for k, v in handover.items()}])
    total = sum(len(s) for s in sequences.values())
    return CalibrationSet(out, counts["encoder"], counts["decoder"], total, total * SEQUENCE_TOKENS, amax)
