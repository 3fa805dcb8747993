"""The engine manifest: what an engine directory holds, what it was built from, and whether it is still current.

An engine directory is current when its manifest names the same source checkpoint (file hashes), the same build
settings (format, quantization, opset), the same builder code (a digest of the export, plugin and build sources)
and every graph file still has its recorded hash. `python -m build_engines build` reuses a current directory.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
BUILDER_SOURCES = (  # what decides the fp32 graphs' content (not the runtime's row handling)
    *(f"ced/steps/{m}.py" for m in ("common", "decoder_step", "encoder_step", "graph_ops", "layout", "pointer_step",
                                    "stored_weights", "draft_step")),
    *(f"build_engines/export/{m}.py" for m in ("onnx_export", "stored_role")),
    "build_engines/build/onnx_build.py", "build_engines/build/stored_build.py", "build_engines/build/trt_build.py",
    "ced/model", "ced/routing/pointer_head.py", "plugins")
QUANT_BUILDER_SOURCES = ("build_engines/build/quant_build.py", "build_engines/build/release_build.py",
                         "build_engines/quantize", "ced/steps/kv_state.py")  # quantized builds only
# what every engine is computed from (a release checkpoint is sharded)
CHECKPOINT_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json", "router/router.safetensors",
                    "router/router_config.json", "drafter/config.json", "drafter/model.safetensors")
CALIBRATION_FILES = ("heldout/val.jsonl",)  # calibration text: keys ModelOpt-calibrated builds only


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def calibrated(quant: str) -> bool:
    """Whether a build of this quantization mode is calibrated on held-out text (ModelOpt PTQ)."""
    return quant in ("fp8", "int8", "nvfp4")


def source_digest(model_dir: Path, quant: str = "none") -> dict[str, str]:
    """sha256 of each checkpoint file an engine of mode `quant` depends on (adapters are inputs, not part of an engine).

    Why per mode: calibration text changes only what ModelOpt calibrates, so it must not make fp32 engines stale."""
    patterns = CHECKPOINT_FILES + (CALIBRATION_FILES if calibrated(quant) else ())
    files = sorted({p for pattern in patterns for p in model_dir.glob(pattern) if p.is_file()})
    return {str(p.relative_to(model_dir)): sha256_file(p) for p in files}


def builder_digest(quant: str = "none") -> str:
    """One hash over the sources that decide what a build writes: a code change makes old engines stale.

    The quantization code keys quantized builds only, so editing it leaves fp32 engines current."""
    h = hashlib.sha256()
    for entry in BUILDER_SOURCES + (QUANT_BUILDER_SOURCES if quant != "none" else ()):
        root = PROJECT_ROOT / entry
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for f in files:
            h.update(str(f.relative_to(PROJECT_ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in ("torch", "onnx", "onnxruntime", "onnxscript", "tensorrt", "nvidia-modelopt"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


@dataclass(frozen=True)
class BuildSettings:
    format: str
    quant: str
    opset: int
    kv_quant: str = "none"  # fp8: rings and global-KV stores as fp8 e4m3 (`quantize/kv_cache.py`)
    expert_chunk_bytes: int | None = None  # stored-weight builds: `--expert-chunk-bytes` (None: the default)

    def as_dict(self) -> dict[str, Any]:
        """`kv_quant` and `expert_chunk_bytes` appear only when set, so the manifests of builds without them are
        unchanged (and current)."""
        return {"format": self.format, "quant": self.quant, "opset": self.opset,
                **({"kv_quant": self.kv_quant} if self.kv_quant != "none" else {}),
                **({"expert_chunk_bytes": self.expert_chunk_bytes} if self.expert_chunk_bytes is not None else {})}


def read_manifest(engine_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((engine_dir / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def stale_reason(engine_dir: Path, model_dir: Path, settings: BuildSettings) -> str | None:
    """None when `engine_dir` is current for this checkpoint, settings and builder code; else why it is not."""
    manifest = read_manifest(engine_dir)
    if manifest is None:
        return "no manifest"
    if manifest.get("settings") != settings.as_dict():
        return f"built with {manifest.get('settings')}, asked for {settings.as_dict()}"
    if manifest.get("source", {}).get("files") != source_digest(model_dir, settings.quant):
        return "the checkpoint changed"
    if manifest.get("builder", {}).get("code_digest") != builder_digest(settings.quant):
        return "the builder code changed"
    for name, graph in manifest.get("graphs", {}).items():
        path = engine_dir / graph["file"]
        if not path.exists() or sha256_file(path) != graph["sha256"]:
            return f"graph {name} ({graph['file']}) is missing or modified"
        data = engine_dir / graph["data_file"] if "data_file" in graph else None
        if data is not None and (not data.exists() or sha256_file(data) != graph["data_sha256"]):
            return f"the weights of graph {name} ({graph['data_file']}) are missing or modified"
    return None


def write_manifest(engine_dir: Path, manifest: dict[str, Any]) -> Path:
    path = engine_dir / MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)
    return path
