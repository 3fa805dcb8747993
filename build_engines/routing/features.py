"""Per-token H19 of routing items, cached once, and the poolings a router head can read from it.

Why: `train.extract_h19` caches one pooled vector per item, so trying another pooling (max, mean+max, last token,
a learned attention query) would mean another encoder pass over every item (minutes each on CPU). Here the
encoder runs once per item set and keeps H19 for every position of the user turn (float16, flat array + offsets);
any pooling is then a numpy reduction and head experiments take seconds. Only the turn's positions are kept
(the router pools over the user turn), also for later-turn items encoded after a conversation prefix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from build_engines.routing.train import query_ids
from ced.model.network import EncoderEngine
from ced.text.tokenizer import ChatTokenizer, Message

POOLINGS = ("mean", "max", "meanmax", "last", "meanlast")


@dataclass
class TokenFeatures:
    """H19 of every turn position of N items: `values` (total positions, dim) and `offsets` (N + 1,)."""

    values: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def item(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]: self.offsets[i + 1]]

    def pool(self, kind: str) -> np.ndarray:
        """(N, width) pooled features, float32: "mean" (what serving pools today), "max", "meanmax" (both,
        concatenated: 2 x dim), "last" (the last turn position), "meanlast" (mean and last, 2 x dim)."""
        v = self.values.astype(np.float32)
        starts, ends = self.offsets[:-1], self.offsets[1:]
        counts = (ends - starts)[:, None].astype(np.float32)
        if kind == "mean":
            return np.add.reduceat(v, starts, axis=0) / counts
        if kind == "max":
            return np.maximum.reduceat(v, starts, axis=0)
        if kind == "meanmax":
            return np.concatenate([self.pool("mean"), self.pool("max")], 1)
        if kind == "last":
            return v[ends - 1]
        if kind == "meanlast":
            return np.concatenate([self.pool("mean"), self.pool("last")], 1)
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {kind!r}")

    def padded(self, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, T, dim) float32 positions, left-aligned, and (N, T) bool validity; longer turns keep their last
        `max_len` positions (the end markers and the assistant prompt are last)."""
        lengths = np.diff(self.offsets)
        T = int(lengths.max()) if max_len is None else min(int(lengths.max()), max_len)
        out = torch.zeros(len(self), T, self.values.shape[1])
        mask = torch.zeros(len(self), T, dtype=torch.bool)
        for i in range(len(self)):
            x = self.item(i)[-T:]
            out[i, : len(x)] = torch.from_numpy(x.astype(np.float32))
            mask[i, : len(x)] = True
        return out, mask


@torch.no_grad()
def extract_h19_tokens(encoder: EncoderEngine, tok: ChatTokenizer, queries: Sequence[str], cache_dir: Path,
                       model_digest: str, histories: Sequence[Sequence[Message]] | None = None,
                       batch: int = 32) -> TokenFeatures:
    """H19 (mean over the hc streams, as the engine's `h19` output) at every user-turn position of each query,
    encoded as `train.extract_h19` encodes it (same ids, same prefix, right padding), cached under `cache_dir`."""
    if histories is not None and len(histories) != len(queries):
        raise ValueError(f"{len(histories)} histories for {len(queries)} queries")
    hist_key = "" if histories is None else "\x01" + json.dumps([[(m.role, m.content) for m in h] for h in histories])
    key = hashlib.sha256(("tokens\x00" + model_digest + "\x00" + "\x00".join(queries)
                          + hist_key).encode()).hexdigest()[:16]
    path = cache_dir / f"h19tok_{key}.npz"
    if path.exists():
        with np.load(path) as z:
            return TokenFeatures(z["values"], z["offsets"])
    seqs = [query_ids(tok, q, histories[i] if histories is not None else ()) for i, q in enumerate(queries)]
    turn_len = np.array([len(t) for _, t in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(turn_len)])
    values = np.zeros((int(offsets[-1]), encoder.cfg.dim), dtype=np.float16)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
    for start in tqdm(range(0, len(order), batch), desc="H19 per token", leave=False):
        idx = order[start: start + batch]
        lengths = [len(seqs[i][0]) + len(seqs[i][1]) for i in idx]
        ids = torch.full((len(idx), max(lengths)), tok.pad_id, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, : lengths[row]] = torch.tensor(seqs[i][0] + seqs[i][1])
        handover, _ = encoder(ids, encoder.new_state(len(idx)))
        h = handover.encoder_out.float().mean(2)
        for row, i in enumerate(idx):
            p = len(seqs[i][0])
            values[offsets[i]: offsets[i + 1]] = h[row, p: lengths[row]].numpy().astype(np.float16)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.savez(path, values=values, offsets=offsets)
    return TokenFeatures(values, offsets)
