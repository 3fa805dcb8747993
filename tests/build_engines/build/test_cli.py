"""`python -m build_engines build`: reuse, staleness, and clear refusals (TensorRT missing, quantized modes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ced.engine_dir.manifest import BuildSettings, read_manifest, stale_reason
from ced.steps.opset import OPSET
from plugins.tensorrt_support import tensorrt_missing_reason
from tests.conftest import EMBEDDED
from tests.tiny import PROJECT_ROOT


def _build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "build_engines", "build", *args], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(tensorrt_missing_reason() is None, reason="TensorRT is installed here: the trt build runs instead")
def test_trt_format_without_tensorrt_exits_2_naming_what_is_missing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = _build("--model", str(EMBEDDED), "--out", str(tmp_path / "trt"), "--format", "trt")
    assert result.returncode == 2, result.stderr
    assert "tensorrt" in result.stderr.lower() and "NGC" in result.stderr and "NVIDIA GPU" in result.stderr
    assert not (tmp_path / "trt" / "manifest.json").exists(), "nothing pretends to have built an engine"


def test_nvfp4_is_refused_without_a_gpu_with_a_reason(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """fp8 and int8 are built (tests/build_engines/quantize/); nvfp4 needs CUDA."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: nvfp4 builds there; this test covers the refusal without one")
    result = _build("--model", str(EMBEDDED), "--out", str(tmp_path / "nvfp4"), "--quant", "nvfp4")
    assert result.returncode == 2 and "--quant nvfp4 needs an NVIDIA GPU" in result.stderr


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = _build("--model", str(tmp_path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "no config.json" in result.stderr


@pytest.mark.slow
def test_an_up_to_date_directory_is_reused_and_a_modified_one_is_stale(default_engines, tmp_path) -> None:  # type: ignore[no-untyped-def]
    again = _build("--model", str(EMBEDDED), "--out", str(default_engines))
    assert again.returncode == 0 and "up to date" in again.stdout
    manifest = read_manifest(default_engines)
    assert manifest is not None and manifest["settings"] == BuildSettings("onnx", "none", OPSET).as_dict()
    # the embedded default ships a DSpark drafter: its graph is built, its files key the engines too
    assert (set(manifest["graphs"]) == {"encoder", "decoder", "pointer", "drafter"}
            and manifest["source"]["files"]["model.safetensors"])
    assert manifest["source"]["files"]["drafter/model.safetensors"] and manifest["drafter"]["dspark_block_size"] == 5
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in default_engines.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    assert stale_reason(copy, EMBEDDED, BuildSettings("onnx", "none", OPSET)) is None
    (copy / "decoder.onnx").write_bytes(b"not a graph")
    assert "decoder" in (stale_reason(copy, EMBEDDED, BuildSettings("onnx", "none", OPSET)) or "")
    assert "built with" in (stale_reason(copy, EMBEDDED, BuildSettings("trt", "none", OPSET)) or "")
