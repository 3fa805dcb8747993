"""First-start initialisation of an adapter registry from a model folder's `adapters/` (idempotent)."""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

from tritonserver_backend.adapters.registry import REGISTRY_FILE, Registry

DESCRIPTION_KEY = "mol2_description"
INIT_LOCK = ".init.lock"  # held while one process creates the registry


def description_of(adapter_dir: Path) -> str:
    """The router's text for an adapter: `mol2_description` in its adapter_config.json, else its name."""
    meta = json.loads((adapter_dir / "adapter_config.json").read_text())
    return str(meta.get(DESCRIPTION_KEY) or adapter_dir.name.replace("_", " "))


def ensure_registry(root: str | Path, model_dir: str | Path) -> Registry:
    """Create the registry with the model's bundled adapters if it does not exist yet (copied under root/adapters).

    Every model of the repository calls this as it starts, each in its own stub process and at the same moment. The
    first to take the init lock creates the registry; the others wait on the lock and then find it complete. An
    adapter is copied into a temporary folder and renamed into place, and the registry file is written once with
    every entry, so no process ever reads a half-copied adapter or a part of the bundled set."""
    root, model_dir = Path(root), Path(model_dir)
    if (root / REGISTRY_FILE).exists():
        return Registry(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / INIT_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / REGISTRY_FILE).exists():
            _initialise(root, model_dir)
    return Registry(root)


def _initialise(root: Path, model_dir: Path) -> None:
    adapters = model_dir / "adapters"
    bundled = sorted(p for p in adapters.glob("*") if (p / "adapter_config.json").exists()) if adapters.exists() else []
    for src in bundled:
        dst = root / "adapters" / src.name
        if dst.exists():
            continue  # a folder of that name is already there (an operator's): kept as it is
        partial = dst.with_name(f".{src.name}.copying")
        shutil.rmtree(partial, ignore_errors=True)  # left by a start that died while copying
        shutil.copytree(src, partial)
        partial.rename(dst)
    # one atomic write (an empty registry too): the fast path above never reads a file being written
    Registry(root).put_all([(src.name, f"adapters/{src.name}", description_of(src)) for src in bundled])
