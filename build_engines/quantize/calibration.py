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

from build_engines.export.layout import StepLayout
from build_engines.export.rows import (
    HANDOVER_FIELDS,
    HANDOVER_KEYS,
    DecoderRow,
    EncoderRow,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)

from .heldout import HeldoutText, token_sequences
from .kv_cache import StateAmax
from .scoring import Adapters, Runner

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


def write_calibration(out: Path, layout: StepLayout, encoder: Runner, decoder: Runner, heldout: HeldoutText, tokenizer: Path,
                      adapters: Adapters) -> CalibrationSet:
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
        erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
        outs = []
        for lo, hi in ((0, FIRST_CHUNK), (FIRST_CHUNK, ids.shape[1])):
            feed = encoder_inputs(layout, [erow], ids[:, lo:hi])
            save("encoder", feed)
            outs.append(encoder(feed))
            amax.encoder(layout, outs[-1], [erow.position], hi - lo)
            absorb_encoder(layout, [erow], outs[-1], hi - lo)
        handover = {k: np.concatenate([o[k][0] for o in outs]) for k in HANDOVER_KEYS}
        n = ids.shape[1] - DECODE_STEPS
        drow.absorb(layout, {k: v[:n] for k, v in handover.items()})
        feed = decoder_inputs(layout, [drow], None, [slot])
        save("decoder", feed)
        result = decoder({**feed, **adapters.bank})
        amax.decoder(result, [drow.replay_count])
        absorb_decoder([drow], result, feed, True, [slot])  # decode steps on real rings
        for t in range(n, ids.shape[1]):
            row = {k: v[t:t + 1] for k, v in handover.items()}
            drow.absorb(layout, row)
            feed = decoder_inputs(layout, [drow], [{k: row[k] for k in HANDOVER_FIELDS}], [slot])
            save("decoder", feed)
            result = decoder({**feed, **adapters.bank})
            amax.decoder(result, [1])
            absorb_decoder([drow], result, feed, False, [slot])
    total = sum(len(s) for s in sequences.values())
    return CalibrationSet(out, counts["encoder"], counts["decoder"], total, total * SEQUENCE_TOKENS, amax)
