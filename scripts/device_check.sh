#!/usr/bin/env bash
# The GPU check of the mol2 Triton kernels, in one command (see benchmarks/device_check.py for what it measures):
#   bash scripts/device_check.sh [--iters N] [--no-model] [--no-sweep] [--json FILE]
# Runs on an NVIDIA GPU machine with torch (CUDA) and OpenAI Triton already installed; installs nothing and needs no
# network. Uses .venv/bin/python when the checkout has one, else $PYTHON, else the system python3, with the repo
# root on PYTHONPATH. Exit 0: every kernel agrees with its reference (results in docs/kernels.md and printed);
# 1: a kernel disagrees (listed at the end); 2: this machine cannot run the check (no CUDA, no torch or triton).
# When $OUT is set (the device runner's output folder) docs/kernels.md and the raw JSON are copied there too.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
JSON="${OUT:-/tmp}/device_check.json"
status=0
"$PY" -m benchmarks device-check --force --json "$JSON" "$@" || status=$?  # --force: its job is to rewrite the GPU section of docs/kernels.md
if [ -n "${OUT:-}" ] && [ -f docs/kernels.md ] && [ "$status" -ne 2 ]; then cp docs/kernels.md "$OUT/kernels.md"; fi
exit "$status"
