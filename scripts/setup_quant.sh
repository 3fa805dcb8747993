#!/usr/bin/env bash
# Create (or update) .venv-quant: the quantization stage's own environment (ModelOpt 0.47 + onnxruntime CPU).
# Why separate: ModelOpt pulls numpy 2, and numpy 2 corrupts tensors in Triton 2.51's Python backend, so the serving
# venv (.venv) keeps numpy<2 and only runs the resulting Q/DQ graphs. The pinned versions of requirements/quant.lock
# (from requirements/quant.in; regenerate: bash scripts/lock.sh quant) hold torch at 2.13.0+cpu, not a 3 GB CUDA
# build. ModelOpt's `[onnx]` extra is avoided (it pulls onnxruntime-gpu and cupy); the pieces of it that
# `modelopt.onnx.quantization` imports are listed instead. Idempotent; a few seconds with a warm uv cache.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/side_venv.sh
side_venv .venv-quant requirements/quant.lock
.venv-quant/bin/python -c 'import modelopt.onnx.quantization, numpy, importlib.metadata as m; print("quantization environment ready: modelopt", m.version("nvidia-modelopt"), "numpy", numpy.__version__)'
