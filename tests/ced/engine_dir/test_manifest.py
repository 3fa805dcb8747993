"""What makes an engine directory stale: calibration text keys only calibrated (ModelOpt) builds, every shard of a
sharded checkpoint keys every build, quantization code keys only quantized builds."""

from __future__ import annotations

import json
from pathlib import Path

from ced.engine_dir.manifest import BuildSettings, builder_digest, source_digest, stale_reason, write_manifest


def _checkpoint(root: Path) -> Path:
    (root / "heldout").mkdir(parents=True)
    (root / "router").mkdir()
    (root / "config.json").write_text("{}")
    (root / "model-00001-of-00002.safetensors").write_bytes(b"shard one")
    (root / "model-00002-of-00002.safetensors").write_bytes(b"shard two")
    (root / "router" / "router.safetensors").write_bytes(b"router")
    (root / "heldout" / "val.jsonl").write_text('{"kind": "base", "text": "a"}\n')
    return root


def test_calibration_text_keys_only_calibrated_builds(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "ckpt")
    fp32, int8 = source_digest(model), source_digest(model, "int8")
    assert "heldout/val.jsonl" not in fp32 and "heldout/val.jsonl" in int8
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json",
            "router/router.safetensors"} <= set(fp32)
    (model / "heldout" / "val.jsonl").write_text('{"kind": "base", "text": "other text"}\n')
    assert source_digest(model) == fp32, "fp32 engines do not depend on calibration text"
    assert source_digest(model, "int8") != int8 and source_digest(model, "fp8") != int8
    (model / "model-00002-of-00002.safetensors").write_bytes(b"shard two, changed")
    assert source_digest(model) != fp32, "every shard is part of the checkpoint"


def test_stale_reason_per_mode(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "ckpt")
    for quant in ("none", "int8"):
        out = tmp_path / quant
        out.mkdir()
        settings = BuildSettings("onnx", quant, 18)
        write_manifest(out, {"settings": settings.as_dict(), "source": {"files": source_digest(model, quant)},
                             "builder": {"code_digest": builder_digest(quant)}, "graphs": {}})
        assert stale_reason(out, model, settings) is None
    (model / "heldout" / "val.jsonl").write_text('{"kind": "base", "text": "new calibration text"}\n')
    assert stale_reason(tmp_path / "none", model, BuildSettings("onnx", "none", 18)) is None
    assert stale_reason(tmp_path / "int8", model, BuildSettings("onnx", "int8", 18)) == "the checkpoint changed"
    manifest = json.loads((tmp_path / "none" / "manifest.json").read_text())
    assert manifest["builder"]["code_digest"] != builder_digest("int8"), "quantization code keys quantized builds"
