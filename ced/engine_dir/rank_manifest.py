"""The rank-local weights' manifest: what a parallel torch engine checks before it reads `rank<r>/<role>.safetensors`.

Written by `python -m build_engines build --tensor-parallel-size N` (build_engines/build/rank_build.py); read here by
the serving engines, which must not import the build pipeline.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ced.engine_dir.manifest import PROJECT_ROOT, source_digest

KIND = "rank-shards"
ROLE_NAMES = ("encoder", "decoder")
SOURCES = ("build_engines/build/rank_build.py", "ced/engine_dir/rank_manifest.py",
           "ced/parallel/layout.py", "ced/parallel/network.py",
           "ced/parallel/shards.py")


def rank_file(directory: Path, rank: int, role: str) -> Path:
    return Path(directory) / f"rank{rank}" / f"{role}.safetensors"


def code_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((PROJECT_ROOT / name).read_bytes())
    return h.hexdigest()[:16]


def stale_reason(directory: Path, model_dir: Path, world: int, expert_parallel: bool) -> str | None:
    """Why the rank-local build in `directory` cannot serve this checkpoint and layout (None: it can)."""
    path = Path(directory) / "manifest.json"
    if not path.exists():
        return "no manifest"
    manifest = json.loads(path.read_text())
    if manifest.get("kind") != KIND:
        return f"it holds {manifest.get('kind', 'engines of another kind')}, not rank-local weights"
    if (manifest["tensor_parallel_size"], manifest["expert_parallel"]) != (world, expert_parallel):
        return (f"built for tensor_parallel_size {manifest['tensor_parallel_size']}, expert parallel "
                f"{manifest['expert_parallel']}")
    if manifest["source"] != source_digest(Path(model_dir)):
        return "the checkpoint changed"
    if manifest["code_digest"] != code_digest():
        return "the layout code changed"
    missing = [str(rank_file(directory, r, role)) for r in range(world) for role in ROLE_NAMES
               if not rank_file(directory, r, role).exists()]
    return f"missing {missing}" if missing else None
