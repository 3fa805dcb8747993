"""Quantized builds (ModelOpt post-training quantization): the `--quant` option of `python -m build_engines build`.

Only `none` is built today; fp8, int8 and nvfp4 are the ModelOpt issue's work. The plumbing is here so the build
command, the manifest and the runtimes already carry the choice.
"""

from __future__ import annotations

QUANT_MODES = ("none", "fp8", "int8", "nvfp4")
BUILT_MODES = ("none",)


class QuantizationUnavailable(RuntimeError):
    """A quantized build that this checkout cannot produce; the message says why."""


def check_quant(mode: str) -> None:
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown --quant {mode!r}; choose one of {list(QUANT_MODES)}")
    if mode not in BUILT_MODES:
        raise QuantizationUnavailable(
            f"--quant {mode} is not implemented yet: ModelOpt post-training quantization of the encoder and decoder "
            f"(calibrated on held-out corpus text, Q/DQ that onnxruntime runs on CPU; nvfp4 on a GPU) is the quantized-builds "
            f"issue's work. Build with --quant none.")
