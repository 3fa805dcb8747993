#!/usr/bin/env bash
# Create (or update) .venv-quant: the quantization stage's own environment (ModelOpt 0.47 + onnxruntime CPU).
# Why separate: ModelOpt pulls numpy 2, and numpy 2 corrupts tensors in Triton 2.51's Python backend, so the serving
# venv (.venv) keeps numpy<2 and only runs the resulting Q/DQ graphs. torch==2.13.0 is installed first so pip takes
# the CPU build, not a 3 GB CUDA one. ModelOpt's `[onnx]` extra is avoided (it pulls onnxruntime-gpu and cupy); the
# pieces of it that `modelopt.onnx.quantization` imports are listed instead. Idempotent; about 40 s with a warm cache.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/side_venv.sh
side_venv .venv-quant
.venv-quant/bin/python -m pip install --quiet "nvidia-modelopt==0.47.0" requests huggingface_hub "onnx>=1.17,<2" \
    "onnxruntime>=1.20,<2" onnxscript onnx-graphsurgeon onnxconverter-common onnxslim polygraphy lief cppimport ml_dtypes
.venv-quant/bin/python -c 'import modelopt.onnx.quantization, numpy, importlib.metadata as m; print("quantization environment ready: modelopt", m.version("nvidia-modelopt"), "numpy", numpy.__version__)'
