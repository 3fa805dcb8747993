"""Adapters for the decoder engine: the registry's adapters in numbered slots of one stacked bank.

Slot 0 is the base model. Loading, updating and unloading an adapter change the registry; `sync` brings the slots
in line: a new version of an adapter takes a new slot while turns in flight keep the old one (they hold the slot),
and a slot is reused only when no turn holds it any more. The bank is restacked and handed to the engine only when
the slot table changes, never per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ced.lora import Adapter, AdapterBank, AdapterError
from ced.steps.lora_stacked import stack_adapters
from tritonserver_backend.adapters.registry import Registry
from tritonserver_backend.engines import StepEngine
from tritonserver_backend.errors import UnknownAdapter


@dataclass
class _Slot:
    adapter: Adapter | None
    stamp: tuple[str, int, int] | None = None  # (path, mtime_ns, size) of the weights file it was read from
    holders: int = 0
    retired: bool = False


@dataclass
class SlotTable:
    slots: list[_Slot] = field(default_factory=lambda: [_Slot(None)])


class AdapterSlots:
    def __init__(self, engine: StepEngine, registry: Registry, model: torch.nn.Module) -> None:
        self.engine, self.registry = engine, registry
        self._reader = AdapterBank(engine.cfg, model)  # reads and validates PEFT files against the network's shapes
        self._table = SlotTable()
        self._current: dict[int, int] = {}  # adapter hash -> slot of its current version
        self.sync(force=True)

    # ------------------------------------------------------------------ registry -> slots
    def sync(self, force: bool = False) -> None:
        changed = self.registry.refresh() or force
        wanted = {e.hash: e for e in self.registry.entries()}
        for h in [h for h in self._current if h not in wanted]:  # unloaded
            self._retire(self._current.pop(h))
            changed = True
        for h, entry in wanted.items():
            weights = self.registry.resolve_path(entry) / "adapter_model.safetensors"
            try:
                st = weights.stat()
            except FileNotFoundError:
                continue
            stamp = (entry.path, st.st_mtime_ns, st.st_size)
            slot = self._current.get(h)
            if slot is not None and self._table.slots[slot].stamp == stamp:
                continue
            try:
                adapter = self._read(self.registry.resolve_path(entry), entry.name, entry.path)
            except AdapterError:
                continue  # the admin model validated it; a file replaced by a broken one keeps the last good version
            if slot is not None:
                self._retire(slot)
            self._current[h] = self._place(_Slot(adapter, stamp))
            changed = True
        if changed:
            self._restack()

    def _read(self, directory: Path, name: str, path_id: str) -> Adapter:
        from ced.lora import read_adapter

        return read_adapter(directory, self.engine.cfg, self._reader.linear_shapes, name, path_id)

    def _place(self, slot: _Slot) -> int:
        for i, s in enumerate(self._table.slots[1:], start=1):
            if s.retired and s.holders == 0:
                self._table.slots[i] = slot
                return i
        self._table.slots.append(slot)
        return len(self._table.slots) - 1

    def _retire(self, index: int) -> None:
        self._table.slots[index].retired = True

    def _restack(self) -> None:
        adapters = [None if (s.retired and s.holders == 0) else s.adapter for s in self._table.slots]
        adapters[0] = None
        self.engine.set_lora_bank(stack_adapters(self.engine.layout, adapters))

    # ------------------------------------------------------------------ turns
    def acquire(self, adapter_hash: int) -> tuple[int, Adapter | None]:
        """The slot of the adapter's current version (0 for the base), held until `release`."""
        self.sync()
        if adapter_hash == 0:
            return 0, None
        slot = self._current.get(int(adapter_hash))
        if slot is None:
            names = sorted(e.name for e in self.registry.entries())
            what = "the adapter this request names" if adapter_hash < 0 else f"adapter hash {adapter_hash}"
            raise UnknownAdapter(f"{what} is not loaded (unloaded meanwhile?); loaded adapters: {names}")
        self._table.slots[slot].holders += 1
        return slot, self._table.slots[slot].adapter

    def release(self, slot: int) -> None:
        if slot:
            self._table.slots[slot].holders -= 1

    def names(self) -> list[str]:
        return sorted(s.adapter.name for i, s in enumerate(self._table.slots)
                      if i and not s.retired and s.adapter is not None)
