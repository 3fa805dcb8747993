"""Token streams for training and evaluation: tokenized once per (source, split), cached, sampled with a seed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from ced.text.tokenizer import ChatTokenizer


def tokenizer_digest(tokenizer_path: Path) -> str:
    return hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest()[:12]


def token_stream(data_dir: Path, source: str, split: str, tokenizer: ChatTokenizer, cache_dir: Path,
                 digest: str) -> np.ndarray:
    """All documents of a split as one int32 stream (<|bos|> doc <|eos|> ...), cached on disk by tokenizer hash."""
    from build_engines.data.corpora.reader import iter_documents  # the data step is an optional stage of the pipeline

    cache = cache_dir / f"{source}.{split}.{digest}.npy"
    if cache.exists():
        return np.load(cache)
    docs = list(iter_documents(data_dir, source, split))
    ids: list[int] = []
    for start in tqdm(range(0, len(docs), 256), desc=f"tokenize {source}/{split}", leave=False):
        for enc in tokenizer.tok.encode_batch(docs[start : start + 256], add_special_tokens=False):
            ids.append(tokenizer.bos_id)
            ids.extend(enc.ids)
            ids.append(tokenizer.eos_id)
    arr = np.asarray(ids, dtype=np.int32)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp.npy")
    np.save(tmp, arr)
    tmp.replace(cache)
    return arr


@dataclass
class Mixture:
    """Named token streams sampled with fixed weights: each batch row is one random window of one source."""

    streams: dict[str, np.ndarray]
    weights: dict[str, float]

    def __post_init__(self) -> None:
        short = [s for s, a in self.streams.items() if a.shape[0] < 2]
        if short:
            raise ValueError(f"sources {short} have no tokens")
        self.names = sorted(self.streams)
        w = np.array([self.weights.get(n, 0.0) for n in self.names], dtype=np.float64)
        if w.sum() <= 0:
            raise ValueError("mixture weights must have a positive sum")
        self.probs = w / w.sum()

    def batch(self, rng: np.random.Generator, batch: int, seq_len: int) -> torch.Tensor:
        """(batch, seq_len + 1) int64 windows; inputs are [:, :-1], targets [:, 1:]."""
        rows = []
        for _ in range(batch):
            name = self.names[rng.choice(len(self.names), p=self.probs)]
            arr = self.streams[name]
            span = seq_len + 1
            if arr.shape[0] <= span:
                window = np.resize(arr, span)
            else:
                start = int(rng.integers(0, arr.shape[0] - span))
                window = arr[start : start + span]
            rows.append(torch.from_numpy(window.astype(np.int64)))
        return torch.stack(rows)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> list[torch.Tensor]:
    """Non-overlapping windows from the start of a held-out stream (deterministic, no sampling)."""
    span = seq_len + 1
    n = min(max_windows, max(1, (stream.shape[0] - 1) // seq_len))
    out = []
    for i in range(n):
        w = stream[i * seq_len : i * seq_len + span]
        if w.shape[0] < 2:
            break
        out.append(torch.from_numpy(w.astype(np.int64)).unsqueeze(0))
    return out


def size_weights(streams: dict[str, np.ndarray], names: Sequence[str], power: float = 0.5) -> dict[str, float]:
    """Sampling weights proportional to size**power (tempered, so small sources are not drowned)."""
    return {n: float(streams[n].shape[0]) ** power for n in names}
