#!/usr/bin/env bash
# Regenerate the lock files the setup scripts install from (requirements/*.lock) with `uv pip compile`, through the
# same indexes, find-links and constraints as the installs (scripts/uv_env.sh), for this machine's Python 3.11,
# requirements/NAME.in -> requirements/NAME.lock:
#   main    .venv         this project (editable) with its dev and serve extras (scripts/setup.sh)
#   dynamo  .venv-dynamo  this project (editable) with its dynamo extra, and Dynamo's runtime (scripts/setup_dynamo.sh)
#   quant   .venv-quant   ModelOpt and the ONNX tools of the quantization stage (scripts/setup_quant.sh)
#   eval    .venv-eval    lm-evaluation-harness (scripts/setup_eval.sh)
# Usage: bash scripts/lock.sh [NAME...] [OPTION...]   (every lock without a NAME). A lock's existing pins are kept
# unless a requirement changed or an option of uv pip compile asks for newer ones: --upgrade, --upgrade-package=NAME.
# numpy <2 is a requirement of main and dynamo (pyproject.toml); the CPU build of torch (2.13.0+cpu, from pip's
# find-links) is checked here: `torch==2.13.0` alone also matches PyPI's CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/uv_env.sh
names=() options=()
for arg in "$@"; do
    case "$arg" in -*) options+=("$arg") ;; *) names+=("$arg") ;; esac
done
[ "${#names[@]}" -gt 0 ] || names=(main dynamo quant eval)
for name in "${names[@]}"; do
    [ -f "requirements/$name.in" ] || { echo "no requirements/$name.in (main, dynamo, quant, eval)" >&2; exit 2; }
    uv pip compile --quiet --python "$PY" --custom-compile-command "bash scripts/lock.sh $name" \
        --output-file "requirements/$name.lock" ${options[@]+"${options[@]}"} "requirements/$name.in"
    if grep -q '^torch==' "requirements/$name.lock" && ! grep -q '^torch==.*+cpu$' "requirements/$name.lock"; then
        echo "requirements/$name.lock: $(grep '^torch==' "requirements/$name.lock") is not the CPU build" >&2; exit 1
    fi
    echo "requirements/$name.lock: $(grep -c '^[-A-Za-z0-9]' "requirements/$name.lock") packages"
done
