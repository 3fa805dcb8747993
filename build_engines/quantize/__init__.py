"""Quantized builds (ModelOpt post-training quantization): the `--quant` option of `python -m build_engines build`.

`fp8` and `int8` are built on CPU: ModelOpt ONNX PTQ of the encoder and decoder graphs, calibrated on held-out text,
standard QuantizeLinear/DequantizeLinear that onnxruntime runs (docs/quantization.md). `nvfp4` is refused on a
machine without an NVIDIA GPU: ModelOpt's NVFP4 quantizers run only on CUDA tensors. `release` keeps a
released-format checkpoint's own fp8/fp4 weights as stored, dequantized in the graph (`release_weights.py`).
"""

from __future__ import annotations

QUANT_MODES = ("none", "fp8", "int8", "nvfp4", "release")
BUILT_MODES = ("none", "fp8", "int8", "release")
KV_QUANT_MODES = ("none", "fp8")  # fp8: rings and global-KV stores as fp8 e4m3 (kv_cache.py); calibrated builds only


class QuantizationUnavailable(RuntimeError):
    """A quantized build that this checkout cannot produce here; the message says why."""


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def check_quant(mode: str, kv_quant: str = "none", fmt: str = "onnx") -> None:
    """Refuse what cannot be built here, before any work (QuantizationUnavailable names why)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown --quant {mode!r}; choose one of {list(QUANT_MODES)}")
    if kv_quant not in KV_QUANT_MODES:
        raise ValueError(f"unknown --kv-quant {kv_quant!r}; choose one of {list(KV_QUANT_MODES)}")
    if kv_quant != "none" and mode not in ("fp8", "int8"):
        raise QuantizationUnavailable(f"--kv-quant {kv_quant} needs a calibrated build (--quant fp8 or int8): its "
                                      f"per-tensor scales come from the calibration run; --quant {mode} has none")
    if kv_quant != "none" and fmt != "onnx":
        raise QuantizationUnavailable(f"--kv-quant {kv_quant} is written for the ONNX engines (onnxruntime); the "
                                      f"TensorRT runtime does not bind fp8 state yet")
    if mode == "nvfp4":
        where = ("this machine has no CUDA device (torch.cuda.is_available() is False)" if not cuda_available()
                 else "the nvfp4 engine path (calibration on the GPU, FP4 Q/DQ export) is not written yet")
        raise QuantizationUnavailable(
            f"--quant nvfp4 needs an NVIDIA GPU: ModelOpt's NVFP4 quantization runs only on CUDA tensors (and its "
            f"engines need a Blackwell-class GPU with TensorRT to run in FP4); {where}. Build --quant fp8 or int8 on "
            f"CPU.")
