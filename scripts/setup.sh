#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv with everything the tests and the main job need:
# the pinned versions of requirements/main.lock (regenerate: bash scripts/lock.sh main), this project among them,
# editable, with its dev and serve extras. uv installs them (pinned, with pip's configuration: scripts/uv_env.sh).
# Idempotent: a second run only checks that the pinned packages are present.
# --main-only: .venv alone (scripts/test.sh installs the other environments itself, beside its first engine build).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/uv_env.sh
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 is required, found {sys.version}"'
[ -x .venv/bin/python ] || uv venv --quiet --python "$PY" .venv
uv pip install --quiet --python .venv/bin/python -r requirements/main.lock
.venv/bin/python -c 'import torch, numpy; assert numpy.__version__.startswith("1."), numpy.__version__; print(f"environment ready: torch {torch.__version__}, numpy {numpy.__version__}")'
[ "${1:-}" = "--main-only" ] && exit 0
bash scripts/setup_dynamo.sh  # NVIDIA Dynamo in its own .venv-dynamo (the scale-out deployment and its tests)
