"""A bank serving many adapters with one base: applied per batch row through hooks on the base Linear modules.

No copy of base weights, released parameter names untouched; one decoder serves a batch that mixes adapters (the
Punica/SGMV idea, written plainly). This is the PyTorch reference path; engines take the bank as inputs instead
(`ced.steps.lora_stacked`).
"""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from ced.lora.adapter import Adapter, AdapterError
from ced.lora.peft_io import ADAPTER_WEIGHTS, read_adapter
from ced.model.config import CEDConfig

_ACTIVE_ROWS: contextvars.ContextVar[tuple["Adapter | None", ...] | None] = contextvars.ContextVar(
    "mol2_active_adapter_rows", default=None)


class AdapterBank:
    """Resident adapters by name and hash, applied per batch row through hooks on the base Linear modules.

    Loading, replacing (a new version of the same path) and unloading change only the bank's tables; a request
    that already holds an `Adapter` object keeps computing with that version until it finishes.
    """

    def __init__(self, cfg: CEDConfig, model: nn.Module, enforce_placement: bool = True) -> None:
        self.cfg = cfg
        self.enforce_placement = enforce_placement
        self.linear_shapes = {n: (m.out_features, m.in_features) for n, m in model.named_modules()
                              if isinstance(m, nn.Linear)}
        self._by_name: dict[str, Adapter] = {}
        self._by_hash: dict[int, Adapter] = {}

    # ------------------------------------------------------------------ registry
    def load(self, directory: str | Path, name: str | None = None, path_id: str | None = None) -> Adapter:
        """Load (or replace, if the path is already loaded) an adapter; refused adapters leave the bank as it was."""
        adapter = read_adapter(directory, self.cfg, self.linear_shapes, name, path_id, self.enforce_placement)
        clash = self._by_hash.get(adapter.hash)
        if clash is not None and clash.path != adapter.path:
            raise AdapterError(f"adapter {adapter.name!r}: path hash {adapter.hash} collides with adapter "
                               f"{clash.name!r} ({clash.path})")
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
        return {d.name: self.load(d, name=d.name, path_id=f"adapters/{d.name}") for d in sorted(root.glob("*"))
                if (d / ADAPTER_WEIGHTS).exists()}

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
