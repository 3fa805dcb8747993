"""Fine-tune the domain adapters on request -> answer pairs, keeping their own domain text in every batch.

A pair is tokenized exactly as the serving path feeds the decoder on a session's first turn (`TextService`:
`<|bos|>` then `<|user|> request <|end|>` and the `<|assistant|>` prompt) followed by the answer and `<|end|>`, the
token at which the decoder ends a turn; only the answer and that end token carry loss. Each step also draws
windows of the adapter's own domain text (plain next-token loss), so the adapter keeps what made it better than
the base on its domain. Training starts from the current adapter's factors (same rank, same modules), so the
fine-tuned adapter has exactly the size of the one it replaces.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from build_engines.data.token_data import Mixture
from build_engines.training.train import (
    STATE_FILE,
    TrainSettings,
    adapter_checkpoint_hooks,
    adapter_parameters,
    run_training,
)
from ced.lora import Adapter, AdapterBank, save_adapter
from ced.lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ced.model.network import CEDNetwork
from ced.text.tokenizer import ChatTokenizer, Message

STAGE_KEY = "mol2_training"  # in adapter_config.json: which stage produced the adapter, with its settings


@dataclass(frozen=True)
class AnswerSettings:
    """One adapter's fine-tuning run; recorded in the adapter's config, so a changed setting reruns it."""

    steps: int = 250
    pair_rows: int = 6
    text_rows: int = 2
    seq_len: int = 192
    lr: float = 3e-3
    warmup: int = 10
    text_weight: float = 1.0
    seed: int = 0


def encode_pair(tok: ChatTokenizer, request: str, answer: str, max_len: int) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one pair: the served first-turn prompt, then the answer and `<|end|>`; the mask is 1 on
    the answer tokens and the end token. Cut to `max_len` tokens from the end of the answer."""
    prompt = tok.chat([Message("user", request)], add_generation_prompt=True)
    reply = [*tok.encode(answer), tok.end_of_turn_id]
    ids = (prompt + reply)[:max_len]
    mask = ([0] * len(prompt) + [1] * len(reply))[:max_len]
    return ids, mask


class PairBatches:
    """Batches of `pair_rows` pairs (right-padded) and `text_rows` domain-text windows, as one (2, rows, width)
    tensor: ids and loss mask. Has the `batch(rng, batch, seq_len)` shape `run_training` samples from."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]], text: Mixture, settings: AnswerSettings,
                 pad_id: int) -> None:
        if not pairs:
            raise ValueError("no pairs to fine-tune on")
        self.pairs, self.text, self.settings, self.pad_id = pairs, text, settings, pad_id

    def batch(self, rng: np.random.Generator, batch: int, seq_len: int) -> torch.Tensor:
        s = self.settings
        if batch != s.pair_rows + s.text_rows:
            raise ValueError(f"batch {batch} != pair_rows + text_rows ({s.pair_rows} + {s.text_rows})")
        width = seq_len + 1
        ids = torch.full((2, batch, width), 0, dtype=torch.long)
        ids[0].fill_(self.pad_id)
        for row, k in enumerate(rng.integers(0, len(self.pairs), s.pair_rows)):
            p_ids, p_mask = self.pairs[int(k)]
            n = min(len(p_ids), width)
            ids[0, row, :n] = torch.tensor(p_ids[:n])
            ids[1, row, :n] = torch.tensor(p_mask[:n])
        if s.text_rows:
            ids[0, s.pair_rows:] = self.text.batch(rng, s.text_rows, seq_len)
            ids[1, s.pair_rows:] = 1
        return ids


def _masked_nll(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    weights = mask.flatten().to(losses.dtype)
    return (losses * weights).sum() / weights.sum().clamp(min=1)


def answer_loss(net: CEDNetwork, adapter: Adapter, batch: torch.Tensor, settings: AnswerSettings) -> torch.Tensor:
    """Masked next-token loss on the pairs (cropped to their longest row) plus `text_weight` times the plain loss
    on the text windows, both with W + scale * B @ A substituted for every adapted weight."""
    params = dict(net.named_parameters())
    weights = {f"{m}.weight": params[f"{m}.weight"] + adapter.scale * (b @ a) for m, (a, b) in adapter.weights.items()}
    ids, mask = batch[0], batch[1]
    rows = settings.pair_rows
    used = int(mask[:rows].nonzero()[:, 1].max()) + 1 if rows else 0
    loss = torch.zeros((), device=ids.device)
    if rows:
        pair_ids, pair_mask = ids[:rows, :used], mask[:rows, :used]
        logits = torch.func.functional_call(net, weights, (pair_ids[:, :-1],)).logits
        loss = loss + _masked_nll(logits, pair_ids[:, 1:], pair_mask[:, 1:])
    if settings.text_rows:
        text = ids[rows:]
        logits = torch.func.functional_call(net, weights, (text[:, :-1],)).logits
        loss = loss + settings.text_weight * F.cross_entropy(logits.flatten(0, 1), text[:, 1:].flatten())
    return loss


def trainable_copy(adapter: Adapter) -> Adapter:
    """The adapter's factors as fresh trainable parameters (the loaded adapter stays untouched)."""
    weights = {m: (nn.Parameter(a.detach().clone().float()), nn.Parameter(b.detach().clone().float()))
               for m, (a, b) in adapter.weights.items()}
    return Adapter(adapter.name, adapter.path, adapter.rank, adapter.alpha, weights, version="training")


def stage_record(source_dir: Path, settings: AnswerSettings, pairs_sha256: str) -> dict[str, Any]:
    """What identifies a fine-tuned adapter: the stage, its settings, its pairs (digest of this adapter's
    request/answer list) and the adapter it started from."""
    import hashlib

    start = hashlib.sha256((source_dir / ADAPTER_WEIGHTS).read_bytes()).hexdigest()
    return {"stage": "answers", "settings": asdict(settings), "pairs_sha256": pairs_sha256, "start_sha256": start}


def is_done(out_dir: Path, record: dict[str, Any]) -> bool:
    """Whether `out_dir` already holds the adapter this exact run would write (the stage is then skipped)."""
    cfg = out_dir / ADAPTER_CONFIG
    return ((out_dir / ADAPTER_WEIGHTS).exists() and cfg.exists()
            and json.loads(cfg.read_text()).get(STAGE_KEY) == record)


def tune_adapter(net: CEDNetwork, source_dir: Path, name: str, pairs: list[tuple[list[int], list[int]]], text: Mixture,
                 settings: AnswerSettings, work_dir: Path, out_dir: Path, record: dict[str, Any],
                 pad_id: int) -> list[dict]:
    """Fine-tune the adapter in `source_dir` on `pairs` + `text` and write it to `out_dir` (PEFT layout, the source's
    config keys kept, `mol2_training` added). Resumes from `work_dir` when interrupted."""
    for p in net.parameters():
        p.requires_grad_(False)
    work_dir.mkdir(parents=True, exist_ok=True)
    record_path = work_dir / "record.json"
    if record_path.exists() and json.loads(record_path.read_text()) != record:
        # other pairs or another start: this state is not ours to resume
        (work_dir / STATE_FILE).unlink(missing_ok=True)
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    bank = AdapterBank(net.cfg, net)
    adapter = trainable_copy(bank.load(source_dir, name=name, path_id=f"adapters/{name}"))
    params = adapter_parameters(adapter)
    extra, restore = adapter_checkpoint_hooks(adapter)

    train_settings = TrainSettings(steps=settings.steps, batch=settings.pair_rows + settings.text_rows,
                                   seq_len=settings.seq_len, lr=settings.lr, warmup=settings.warmup, weight_decay=0.0,
                                   seed=settings.seed, checkpoint_every=40)
    batches = PairBatches(pairs, text, settings, pad_id)
    history = run_training(net, params, batches, train_settings, work_dir, f"answers {name}", extra, restore,  # type: ignore[arg-type]
                           lambda batch: answer_loss(net, adapter, batch, settings))
    source_cfg = json.loads((source_dir / ADAPTER_CONFIG).read_text())
    keep = {k: v for k, v in source_cfg.items() if k.startswith("mol2_") and k != STAGE_KEY}
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(tmp, {n: (a.detach(), b.detach()) for n, (a, b) in adapter.weights.items()}, adapter.rank,
                 adapter.alpha, source_cfg.get("base_model_name_or_path", net.cfg.name), keep | {STAGE_KEY: record})
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    (work_dir / "history.json").write_text(json.dumps(history))
    return history
