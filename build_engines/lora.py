"""LoRA adapters in the PEFT layout, placement rules, and a bank serving many adapters with one base.

Placement is the whole trick of MoL2 on a CED: adapters may touch only the first decoder layer's FFN and the
decoder layers after it, so the encoder state and the global KV stay adapter-independent and one history serves
every adapter. `validate_placement` enforces that at load; the bank applies adapters through forward hooks on the
base `nn.Linear` modules (no copy of base weights, released parameter names untouched), per batch row, so one
decoder serves a batch that mixes adapters (the Punica/SGMV idea, written plainly).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import CEDConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_WEIGHT_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# Grouped block-diagonal projection used through its weight directly (einsum), not as a Linear call.
UNSUPPORTED_TARGETS = re.compile(r"\.attn\.wo_a$")


class AdapterError(ValueError):
    """An adapter that cannot be loaded or used; the message names the adapter and the offending modules."""


def adapter_hash(path: str) -> int:
    """31-bit FNV-1a of the adapter path (UTF-8); 0 is reserved for the base model.

    This is the identity that travels as the INT32 `ADAPTER_HASH` tensor from router to decoder.
    """
    h = 0x811C9DC5
    for byte in path.encode("utf-8"):
        h ^= byte
        h = (h * 0x01000193) & 0xFFFFFFFF
    h &= 0x7FFFFFFF
    return h or 1


def decoder_lora_modules(cfg: CEDConfig, model: nn.Module, include_first_decoder_ffn: bool = True) -> dict[str, nn.Linear]:
    """The Linear modules an adapter may target: layer 20's FFN (unless `no20`) and every Linear of 21..39."""
    E = cfg.first_decoder_layer
    allowed: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or UNSUPPORTED_TARGETS.search(name):
            continue
        parts = name.split(".")
        if len(parts) < 3 or parts[0] != "layers":
            continue
        layer = int(parts[1])
        if layer > E or (include_first_decoder_ffn and layer == E and parts[2] == "ffn"):
            allowed[name] = module
    return allowed


def validate_placement(cfg: CEDConfig, modules: Sequence[str], known: set[str]) -> None:
    """Refuse adapters that touch the encoder or layer 20's attention (its compressor and indexer included).

    `known` is the set of every Linear module name in the network. All offending modules are listed at once.
    """
    E = cfg.first_decoder_layer
    unknown = sorted(m for m in modules if m not in known)
    encoder_side: list[str] = []
    unsupported: list[str] = []
    for m in modules:
        if m in unknown:
            continue
        parts = m.split(".")
        if parts[0] != "layers" or int(parts[1]) < E or (int(parts[1]) == E and parts[2] != "ffn"):
            encoder_side.append(m)
        elif UNSUPPORTED_TARGETS.search(m):
            unsupported.append(m)
    problems = []
    if unknown:
        problems.append(f"target modules that do not exist: {unknown}")
    if encoder_side:
        problems.append(
            f"modules on the encoder side (encoder layers, layer {E} attention with its compressor and indexer, embedding, head) "
            f"would make the shared history adapter-dependent: {sorted(encoder_side)}"
        )
    if unsupported:
        problems.append(f"modules LoRA cannot target (grouped projection used through its weight): {sorted(unsupported)}")
    if problems:
        raise AdapterError("; ".join(problems))


@dataclass
class Adapter:
    """One loaded adapter version: name, path, identity hash and per-module (A, B) factors."""

    name: str
    path: str
    rank: int
    alpha: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A (r, in), B (out, r))
    version: str  # sha256 of the weights file: distinguishes an update of the same path
    hash: int = field(init=False)

    def __post_init__(self) -> None:
        self.hash = adapter_hash(self.path)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self) -> list[str]:
        return sorted(self.weights)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def save_adapter(directory: str | Path, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, alpha: float, base_model: str, extra: dict | None = None) -> Path:
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


def random_adapter_weights(modules: dict[str, nn.Linear], rank: int, std: float = 0.02, generator: torch.Generator | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random A and B (B non-zero, unlike training init, so the adapter changes outputs from the start)."""
    out = {}
    for name, linear in modules.items():
        a = torch.randn(rank, linear.in_features, generator=generator) * linear.in_features ** -0.5
        b = torch.randn(linear.out_features, rank, generator=generator) * std
        out[name] = (a, b)
    return out


def _matches_target(module: str, targets: Sequence[str]) -> bool:
    return any(module == t or module.endswith("." + t) for t in targets)


def read_adapter(directory: str | Path, cfg: CEDConfig, linear_shapes: dict[str, tuple[int, int]], name: str | None = None, path_id: str | None = None, enforce_placement: bool = True) -> Adapter:
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
        raise AdapterError(f"adapter {label!r}: r must be a positive int and lora_alpha a number, got r={rank!r} lora_alpha={alpha!r}")
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
                problems.append(f"{module} has A {tuple(a.shape)} / B {tuple(b.shape)}, expected ({rank}, {in_f}) / ({out_f}, {rank}) for rank {rank}")
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


_ACTIVE_ROWS: contextvars.ContextVar[tuple["Adapter | None", ...] | None] = contextvars.ContextVar("mol2_active_adapter_rows", default=None)


class AdapterBank:
    """Resident adapters by name and hash, applied per batch row through hooks on the base Linear modules.

    Loading, replacing (a new version of the same path) and unloading change only the bank's tables; a request
    that already holds an `Adapter` object keeps computing with that version until it finishes.
    """

    def __init__(self, cfg: CEDConfig, model: nn.Module, enforce_placement: bool = True) -> None:
        self.cfg = cfg
        self.enforce_placement = enforce_placement
        self.linear_shapes = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        self._by_name: dict[str, Adapter] = {}
        self._by_hash: dict[int, Adapter] = {}

    # ------------------------------------------------------------------ registry
    def load(self, directory: str | Path, name: str | None = None, path_id: str | None = None) -> Adapter:
        """Load (or replace, if the path is already loaded) an adapter; refused adapters leave the bank as it was."""
        adapter = read_adapter(directory, self.cfg, self.linear_shapes, name, path_id, self.enforce_placement)
        clash = self._by_hash.get(adapter.hash)
        if clash is not None and clash.path != adapter.path:
            raise AdapterError(f"adapter {adapter.name!r}: path hash {adapter.hash} collides with adapter {clash.name!r} ({clash.path})")
        previous = self._by_name.get(adapter.name)
        if previous is not None and previous.path != adapter.path:
            raise AdapterError(f"adapter name {adapter.name!r} is already used by {previous.path}; unload it first")
        if clash is not None:
            del self._by_name[clash.name]
        self._by_name[adapter.name] = adapter
        self._by_hash[adapter.hash] = adapter
        return adapter

    def load_bundled(self, model_dir: str | Path) -> dict[str, Adapter]:
        """Load every adapter shipped with a model (`<model_dir>/adapters/<name>/` holding adapter weights), named
        by its folder with path id `adapters/<name>`, as the embedded default lays them out."""
        root = Path(model_dir) / "adapters"
        return {d.name: self.load(d, name=d.name, path_id=f"adapters/{d.name}") for d in sorted(root.glob("*")) if (d / ADAPTER_WEIGHTS).exists()}

    def unload(self, name: str) -> Adapter:
        adapter = self.get(name)
        del self._by_name[adapter.name]
        del self._by_hash[adapter.hash]
        return adapter

    def get(self, key: str | int) -> Adapter:
        """By name or by hash; unknown keys get an error that lists what is loaded."""
        found = self._by_hash.get(key) if isinstance(key, int) else self._by_name.get(key)
        if found is None:
            kind = "hash" if isinstance(key, int) else "name"
            raise AdapterError(f"unknown adapter {kind} {key!r}; loaded adapters: {sorted(self._by_name)}")
        return found

    def resolve(self, key: str | int | None) -> Adapter | None:
        """None, '' and hash 0 mean the base model."""
        if key is None or key == "" or key == 0:
            return None
        return self.get(key)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    # ------------------------------------------------------------------ application
    def attach(self, model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Hook every Linear of `model`; a hook adds the LoRA delta of the rows whose adapter targets it."""
        handles = []
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                handles.append(module.register_forward_hook(_make_hook(name)))
        return handles

    @staticmethod
    @contextlib.contextmanager
    def rows(adapters: Sequence[Adapter | None]) -> Iterator[None]:
        """Run the enclosed forward with adapter `adapters[b]` on batch row b (None = base)."""
        token = _ACTIVE_ROWS.set(tuple(adapters))
        try:
            yield
        finally:
            _ACTIVE_ROWS.reset(token)


def _make_hook(module_name: str):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
        rows = _ACTIVE_ROWS.get()
        if rows is None or all(a is None or module_name not in a.weights for a in rows):
            return None
        x = inputs[0]
        batch = len(rows)
        # (B, S, in) from attention, or (B*S, in) flattened tokens inside the MoE
        per_row = x.shape[0] // batch if x.dim() == 2 else 1
        if x.shape[0] != batch * per_row:
            raise AdapterError(f"{module_name}: input batch {x.shape[0]} does not split over {batch} adapter rows")
        delta = torch.zeros_like(output)
        groups: dict[int, list[int]] = {}
        for b, adapter in enumerate(rows):
            if adapter is not None and module_name in adapter.weights:
                groups.setdefault(id(adapter), []).append(b)
        for members in groups.values():
            adapter = rows[members[0]]
            assert adapter is not None
            a, b_ = adapter.weights[module_name]
            idx = torch.tensor(members, device=x.device)
            if x.dim() == 2:
                idx = (idx.unsqueeze(1) * per_row + torch.arange(per_row, device=x.device)).flatten()
            xs = x.index_select(0, idx)
            d = (xs.to(a.dtype) @ a.to(x.device).t()) @ b_.to(x.device).t() * adapter.scale
            delta = delta.index_copy(0, idx, d.to(output.dtype))
        return output + delta

    return hook
