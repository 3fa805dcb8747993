"""adapter_admin's logic: validate an adapter against the network before it enters the registry."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from build_engines.formats.checkpoint import load_config
from build_engines.lora import AdapterError, read_adapter
from build_engines.model.network import CEDNetwork

from .errors import BadRequest
from .registry import Registry
from .registry_init import description_of

ACTIONS = ("load", "unload", "list")


class AdminService:
    def __init__(self, model_dir: str | Path, registry: Registry) -> None:
        self.cfg = load_config(model_dir)
        with torch.device("meta"):
            net = CEDNetwork(self.cfg)
        self.shapes = {n: (m.out_features, m.in_features) for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)}
        self.registry = registry

    def handle(self, action: str, name: str, path: str, description: str) -> str:
        """JSON answer. `load` of a name already loaded from the same path is an update to its new version."""
        if action not in ACTIONS:
            raise BadRequest(f"unknown action {action!r}; expected one of {list(ACTIONS)}")
        self.registry.refresh()
        if action == "list":
            return json.dumps({"adapters": [{"name": e.name, "path": e.path, "hash": e.hash, "description": e.description} for e in self.registry.entries()]})
        if not name:
            raise BadRequest(f"{action} needs an adapter name (input `adapter`)")
        if action == "unload":
            entry = self.registry.remove(name)
            return json.dumps({"unloaded": entry.name, "hash": entry.hash})
        if not path:
            raise BadRequest("load needs the adapter directory (input `path`)")
        directory = Path(path) if Path(path).is_absolute() else self.registry.root / path
        try:
            adapter = read_adapter(directory, self.cfg, self.shapes, name, path)
        except (AdapterError, OSError, ValueError) as exc:
            raise BadRequest(str(exc)) from None
        entry = self.registry.put(name, path, description or description_of(directory))
        return json.dumps({"loaded": entry.name, "path": entry.path, "hash": entry.hash, "version": adapter.version, "modules": len(adapter.modules)})
