#!/usr/bin/env bash
# Sourced by the setup scripts of the side environments (setup_quant.sh, setup_eval.sh): `side_venv DIR LOCK` creates
# DIR as a venv of python3.11 (or $PYTHON) when it is missing and installs the pinned versions of LOCK into it with uv
# (pinned, with pip's configuration: scripts/uv_env.sh). Each lock pins torch==2.13.0+cpu, the CPU build (a plain
# `torch` pulls a 3 GB CUDA build). Regenerate a lock: bash scripts/lock.sh quant (or eval).
# shellcheck source=scripts/uv_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/uv_env.sh"
side_venv() {
    [ -x "$1/bin/python" ] || uv venv --quiet --python "$PY" "$1"
    uv pip install --quiet --python "$1/bin/python" -r "$2"
}
