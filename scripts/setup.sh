#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv with everything the tests and the main job need.
# Idempotent: a second run only checks that the pinned packages are present.
# --main-only: .venv alone (scripts/test.sh installs the other environments itself, beside its first engine build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 is required, found {sys.version}"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
.venv/bin/python -m pip install --quiet -e ".[dev,serve]"
.venv/bin/python -c 'import torch, numpy; assert numpy.__version__.startswith("1."), numpy.__version__; print(f"environment ready: torch {torch.__version__}, numpy {numpy.__version__}")'
[ "${1:-}" = "--main-only" ] && exit 0
bash scripts/setup_dynamo.sh  # NVIDIA Dynamo in its own .venv-dynamo (the scale-out deployment and its tests)
