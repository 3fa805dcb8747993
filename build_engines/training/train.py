"""Training of the small CED (base pre-training) and of decoder-side LoRA adapters, resumable and seeded.

Both loops share one step function: next-token cross-entropy over windows sampled from a `Mixture`. Base
training updates every weight; adapter training freezes the base and updates only LoRA factors placed on layer
20's FFN and layers 21..39, so the encoder and the global KV stay identical for all adapters.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from build_engines.data.token_data import Mixture, eval_windows
from build_engines.training.reply_weights import ReplyWeights, weighted_cross_entropy
from ced.lora import Adapter, AdapterBank, decoder_lora_modules, save_adapter
from ced.model.network import CEDNetwork

STATE_FILE = "train_state.pt"


@dataclass
class TrainSettings:
    steps: int
    batch: int
    seq_len: int
    lr: float
    warmup: int
    weight_decay: float
    seed: int
    grad_clip: float = 1.0
    checkpoint_every: int = 100
    compile: bool = False


def pick_device() -> torch.device:
    """A GPU when present, the CPU otherwise (the default run is sized for the 2-core CPU)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Schedule(Protocol):
    """What the learning-rate schedule reads of a stage's settings."""

    lr: float
    warmup: int
    steps: int


def lr_at(step: int, s: Schedule) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def save_atomic(payload: Any, path: Path) -> None:
    """Write then rename, so an interrupted write never leaves a truncated file that a re-run would trust."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def lm_loss(net: CEDNetwork, batch: torch.Tensor, reply_weights: ReplyWeights | None = None) -> torch.Tensor:
    """Next-token cross-entropy; with `reply_weights`, conversations' replies weigh more than their prompts."""
    logits = net(batch[:, :-1]).logits
    return _loss(logits, batch, reply_weights)


def _loss(logits: torch.Tensor, batch: torch.Tensor, reply_weights: ReplyWeights | None) -> torch.Tensor:
    if reply_weights is None:
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    return weighted_cross_entropy(logits, batch[:, 1:], reply_weights.weights(batch[:, :-1]))


def merged_lm_loss(net: CEDNetwork, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float,
                   batch: torch.Tensor, reply_weights: ReplyWeights | None = None) -> torch.Tensor:
    """Loss with W + scale * B @ A substituted for each adapted weight (one adapter for the whole batch).

    Mathematically the bank's hook path; as a pure function of the factors it compiles into one graph and its
    gradients reach only A and B.
    """
    params = dict(net.named_parameters())
    weights = {f"{m}.weight": params[f"{m}.weight"] + scale * (b @ a) for m, (a, b) in lora.items()}
    logits = torch.func.functional_call(net, weights, (batch[:, :-1],)).logits
    return _loss(logits, batch, reply_weights)


def _rng_state(rng: np.random.Generator) -> dict:
    return {"numpy": rng.bit_generator.state, "torch": torch.get_rng_state()}


def run_training(
    net: CEDNetwork,
    params: list[nn.Parameter],
    mixture: Mixture,
    settings: TrainSettings,
    work_dir: Path,
    desc: str,
    extra_state: Callable[[], dict] | None = None,
    restore_extra: Callable[[dict], None] | None = None,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[dict]:
    """The shared loop: AdamW, warm-up + cosine, gradient clipping, periodic resumable checkpoints.

    `work_dir/train_state.pt` holds model/params, optimizer, step and RNG state; a re-run resumes from it and
    produces the same result as an uninterrupted run (same batches, same updates).
    """
    device = next(net.parameters()).device
    work_dir.mkdir(parents=True, exist_ok=True)
    state_path = work_dir / STATE_FILE
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))
    rng = np.random.default_rng(settings.seed)
    torch.manual_seed(settings.seed)
    start, history = 0, []
    if state_path.exists():
        saved = torch.load(state_path, map_location=device, weights_only=False)
        if saved["settings"] != asdict(settings):
            raise ValueError(f"{state_path} was written with other settings {saved['settings']}; remove it to start "
                             f"over")
        net.load_state_dict(saved["model"])
        if restore_extra is not None:
            restore_extra(saved["extra"])
        opt.load_state_dict(saved["optimizer"])
        rng.bit_generator.state = saved["rng"]["numpy"]
        torch.set_rng_state(saved["rng"]["torch"])
        start, history = saved["step"], saved["history"]
    step_loss = loss_fn or (lambda batch: lm_loss(net, batch))
    if settings.compile:
        step_loss = torch.compile(step_loss, dynamic=False)

    def save(step: int) -> None:
        payload = {
            "settings": asdict(settings),
            "model": net.state_dict(),
            "extra": extra_state() if extra_state else {},
            "optimizer": opt.state_dict(),
            "rng": _rng_state(rng),
            "step": step,
            "history": history,
        }
        save_atomic(payload, state_path)

    net.train()
    bar = tqdm(range(start, settings.steps), initial=start, total=settings.steps, desc=desc)
    t0 = time.perf_counter()
    for step in bar:
        batch = mixture.batch(rng, settings.batch, settings.seq_len).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, settings)
        loss = step_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        opt.step()
        value = float(loss)
        if not math.isfinite(value):
            raise FloatingPointError(f"{desc}: loss became {value} at step {step}")
        history.append({"step": step, "loss": value, "seconds": time.perf_counter() - t0})
        bar.set_postfix(loss=f"{value:.3f}")
        if (step + 1) % settings.checkpoint_every == 0 or step + 1 == settings.steps:
            save(step + 1)
    net.eval()
    return history


@torch.no_grad()
def perplexity(net: CEDNetwork, stream: np.ndarray, seq_len: int, max_windows: int,
               adapter: Adapter | None = None) -> float:
    """exp(mean next-token NLL) over non-overlapping held-out windows, optionally under an adapter."""
    device = next(net.parameters()).device
    total, count = 0.0, 0
    net.eval()
    with AdapterBank.rows([adapter]):
        for w in eval_windows(stream, seq_len, max_windows):
            w = w.to(device)
            logits = net(w[:, :-1]).logits
            total += float(F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
            count += w.shape[1] - 1
    return math.exp(total / max(1, count))


# ------------------------------------------------------------------------------------------------- adapters
def trainable_adapter(net: CEDNetwork, name: str, path_id: str, rank: int, alpha: float,
                      include_first_decoder_ffn: bool, seed: int) -> Adapter:
    """LoRA factors on every allowed decoder Linear: A Kaiming-like, B zero (the adapter starts as the base)."""
    g = torch.Generator().manual_seed(seed)
    device = next(net.parameters()).device
    weights = {}
    for module, linear in decoder_lora_modules(net.cfg, net, include_first_decoder_ffn).items():
        a = nn.Parameter((torch.randn(rank, linear.in_features, generator=g) * linear.in_features ** -0.5).to(device))
        b = nn.Parameter(torch.zeros(linear.out_features, rank, device=device))
        weights[module] = (a, b)
    return Adapter(name, path_id, rank, alpha, weights, version="training")


def adapter_parameters(adapter: Adapter) -> list[nn.Parameter]:
    return [p for pair in adapter.weights.values() for p in pair]  # type: ignore[misc]


def adapter_checkpoint_hooks(adapter: Adapter) -> tuple[Callable[[], dict], Callable[[dict], None]]:
    """What a resumable adapter run saves beside the optimizer state (the A/B factors, on CPU) and how it puts them
    back."""
    names = sorted(adapter.weights)

    def extra() -> dict:
        return {n: (a.detach().cpu(), b.detach().cpu()) for n, (a, b) in adapter.weights.items()}

    def restore(saved: dict) -> None:
        for n in names:
            a, b = adapter.weights[n]
            a.data.copy_(saved[n][0])
            b.data.copy_(saved[n][1])

    return extra, restore


def train_adapter(net: CEDNetwork, adapter: Adapter, mixture: Mixture, settings: TrainSettings, work_dir: Path,
                  out_dir: Path, base_model: str, reply_weights: ReplyWeights | None = None) -> list[dict]:
    """Train one adapter with the base frozen; writes it in the PEFT layout to `out_dir`. `reply_weights`: weight
    the replies of chat-formatted streams (reply_weights.py)."""
    for p in net.parameters():
        p.requires_grad_(False)
    params = adapter_parameters(adapter)
    extra, restore = adapter_checkpoint_hooks(adapter)

    def loss(batch: torch.Tensor) -> torch.Tensor:
        return merged_lm_loss(net, adapter.weights, adapter.scale, batch, reply_weights)

    history = run_training(net, params, mixture, settings, work_dir, f"adapter {adapter.name}", extra, restore, loss)
    save_adapter(out_dir, {n: (a.detach(), b.detach()) for n, (a, b) in adapter.weights.items()}, adapter.rank,
                 adapter.alpha, base_model, {"mol2_name": adapter.name})
    (work_dir / "history.json").write_text(json.dumps(history))
    return history
