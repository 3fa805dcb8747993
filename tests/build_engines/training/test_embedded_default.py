"""The committed embedded default: files match the manifest's hashes, the size budget holds, and it generates
exactly the greedy tokens recorded when it was built."""

from __future__ import annotations

import hashlib
import json

from build_engines.training.build_default import smoke_generation
from ced.model.config import get_preset
from tests.tiny import PROJECT_ROOT

MODEL = PROJECT_ROOT / "embedded" / "mol2-small"


def test_manifest_hashes_and_budget() -> None:
    manifest = json.loads((MODEL / "manifest.json").read_text())
    files = manifest["files_sha256"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert {f.split("/")[1] for f in files if f.startswith("adapters/")} == {"L0_chat", "L1_agent", "L2_code",
                                                                             "L3_design"}
    for rel, digest in files.items():
        assert hashlib.sha256((MODEL / rel).read_bytes()).hexdigest() == digest, rel
    total = sum(p.stat().st_size for p in MODEL.rglob("*") if p.is_file())
    assert total <= 40e6, f"embedded default is {total / 1e6:.1f} MB"
    assert manifest["preset"] == get_preset("mol2-small").name


def test_generates_the_recorded_greedy_tokens() -> None:
    recorded = json.loads((MODEL / "manifest.json").read_text())["smoke_generation"]["greedy_tokens"]
    first = smoke_generation(MODEL)
    assert first == recorded
    assert len({tuple(v) for v in first.values()}) > 1, "adapters change what the model says"
