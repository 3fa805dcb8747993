"""First-start initialisation of an adapter registry from a model folder's `adapters/` (idempotent)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .registry import Registry

DESCRIPTION_KEY = "mol2_description"


def description_of(adapter_dir: Path) -> str:
    """The router's text for an adapter: `mol2_description` in its adapter_config.json, else its name."""
    meta = json.loads((adapter_dir / "adapter_config.json").read_text())
    return str(meta.get(DESCRIPTION_KEY) or adapter_dir.name.replace("_", " "))


def ensure_registry(root: str | Path, model_dir: str | Path) -> Registry:
    """Create the registry with the model's bundled adapters if it does not exist yet (copied under root/adapters)."""
    root, model_dir = Path(root), Path(model_dir)
    registry = Registry(root)
    if registry.file.exists():
        return registry
    bundled = sorted(p for p in (model_dir / "adapters").glob("*") if (p / "adapter_config.json").exists()) if (model_dir / "adapters").exists() else []
    for src in bundled:
        dst = root / "adapters" / src.name
        if not dst.exists():
            shutil.copytree(src, dst)
    if registry.file.exists():  # another model process initialised it meanwhile
        return Registry(root)
    for src in bundled:
        registry.put(src.name, f"adapters/{src.name}", description_of(src))
    if not bundled:
        registry.root.mkdir(parents=True, exist_ok=True)
        registry.file.write_text('{"adapters": {}}\n')
    return Registry(root)
