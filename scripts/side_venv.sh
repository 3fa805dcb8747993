#!/usr/bin/env bash
# Sourced by the setup scripts of the side environments (setup_quant.sh, setup_eval.sh): `side_venv DIR` creates DIR
# as a venv of python3.11 (or $PYTHON) when it is missing, upgrades pip and installs torch==2.13.0 first, so that pip
# keeps the CPU build of torch for everything installed after it (a plain `torch` pulls a 3 GB CUDA build).
side_venv() {
    local py="${PYTHON:-python3.11}"
    command -v "$py" >/dev/null || py=python3
    [ -x "$1/bin/python" ] || "$py" -m venv "$1"
    "$1/bin/python" -m pip install --quiet --upgrade pip >/dev/null
    "$1/bin/python" -m pip install --quiet "torch==2.13.0"
}
