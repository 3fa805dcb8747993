"""Adapters on disk in the PEFT layout (`adapter_config.json` + `adapter_model.safetensors`): write, read, check."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ced.lora.adapter import Adapter, AdapterError
from ced.lora.placement import validate_placement
from ced.model.config import CEDConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_WEIGHT_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def save_adapter(directory: str | Path, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, alpha: float,
                 base_model: str, extra: dict | None = None) -> Path:
    """Write an adapter in the PEFT layout (`adapter_config.json` + `adapter_model.safetensors`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(weights),
        "lora_dropout": 0.0,
        "bias": "none",
        **(extra or {}),
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.detach().contiguous().cpu()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.detach().contiguous().cpu()
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    return directory


def random_adapter_weights(modules: dict[str, nn.Linear], rank: int, std: float = 0.02,
                           generator: torch.Generator | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random A and B (B non-zero, unlike training init, so the adapter changes outputs from the start)."""
    out = {}
    for name, linear in modules.items():
        a = torch.randn(rank, linear.in_features, generator=generator) * linear.in_features ** -0.5
        b = torch.randn(linear.out_features, rank, generator=generator) * std
        out[name] = (a, b)
    return out


def _matches_target(module: str, targets: Sequence[str]) -> bool:
    return any(module == t or module.endswith("." + t) for t in targets)


def read_adapter(directory: str | Path, cfg: CEDConfig, linear_shapes: dict[str, tuple[int, int]],
                 name: str | None = None, path_id: str | None = None, enforce_placement: bool = True) -> Adapter:
    """Read and validate a PEFT-layout adapter against the network's Linear shapes.

    Checks: config present and LORA, rank/alpha valid, every weight paired (A and B), shapes (r, in) / (out, r)
    with r equal to the config's rank, finite values, modules exist and match `target_modules`, and placement.
    """
    directory = Path(directory)
    label = name or directory.name
    cfg_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not cfg_path.exists() or not weights_path.exists():
        raise AdapterError(f"adapter {label!r}: {directory} must hold {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    meta = json.loads(cfg_path.read_text())
    if meta.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {label!r}: peft_type {meta.get('peft_type')!r} is not LORA")
    rank, alpha = meta.get("r"), meta.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"adapter {label!r}: r must be a positive int and lora_alpha a number, "
                           f"got r={rank!r} lora_alpha={alpha!r}")
    targets = meta.get("target_modules") or []
    raw = load_file(str(weights_path))
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _WEIGHT_RE.match(key)
        if not m:
            raise AdapterError(f"adapter {label!r}: tensor {key!r} is not a LoRA A/B weight")
        pieces.setdefault(m["module"], {})[m["ab"]] = tensor
    problems: list[str] = []
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in sorted(pieces.items()):
        if set(ab) != {"A", "B"}:
            problems.append(f"{module} lacks lora_{'B' if 'A' in ab else 'A'}")
            continue
        a, b = ab["A"].float(), ab["B"].float()
        if targets and not _matches_target(module, targets):
            problems.append(f"{module} is not in target_modules")
        if module in linear_shapes:
            out_f, in_f = linear_shapes[module]
            if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
                problems.append(f"{module} has A {tuple(a.shape)} / B {tuple(b.shape)}, "
                                f"expected ({rank}, {in_f}) / ({out_f}, {rank}) for rank {rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            problems.append(f"{module} holds NaN or Inf")
        weights[module] = (a, b)
    if not pieces:
        problems.append("no LoRA weights")
    if problems:
        raise AdapterError(f"adapter {label!r}: " + "; ".join(problems))
    if enforce_placement:
        try:
            validate_placement(cfg, list(weights), set(linear_shapes))
        except AdapterError as exc:
            raise AdapterError(f"adapter {label!r} refused: {exc}") from None
    else:
        unknown = sorted(set(weights) - set(linear_shapes))
        if unknown:
            raise AdapterError(f"adapter {label!r}: target modules that do not exist: {unknown}")
    version = hashlib.sha256(weights_path.read_bytes()).hexdigest()[:16]
    return Adapter(label, path_id or str(directory), rank, float(alpha), weights, version)
