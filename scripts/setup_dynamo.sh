#!/usr/bin/env bash
# Create (or update) .venv-dynamo: NVIDIA Dynamo (runtime + OpenAI frontend) and this project, for the scale-out
# deployment (dynamo_deploy/, docs/scale_out.md). Its own venv because ai-dynamo-runtime pins pydantic<=2.13.5 while
# the main .venv carries a newer one, and transformers (an ai-dynamo dependency) must not move the main venv's
# tokenizers. The pinned versions of requirements/dynamo.lock (regenerate: bash scripts/lock.sh dynamo) go in first:
# torch==2.13.0+cpu (so transformers never pulls a CUDA build), numpy<2, the runtime, this project (editable, extra
# dynamo) and ai-dynamo's dependencies but one. ai-dynamo itself is installed without its dependencies: that one
# (aisimulate, used only by Dynamo's planner) downloads from outside the package registries. uv installs everything
# (pinned, with pip's configuration: scripts/uv_env.sh). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/uv_env.sh
V="${DYNAMO_VENV:-.venv-dynamo}"
DYNAMO=1.6.1  # also ai-dynamo-runtime's version in requirements/dynamo.in
[ -x "$V/bin/python" ] || uv venv --quiet --python "$PY" "$V"
if "$V/bin/python" -c "import dynamo.runtime, dynamo.frontend, dynamo_deploy, tritonserver_backend, nixl, xgrammar" 2>/dev/null; then
    echo "dynamo environment ready ($V)"; exit 0
fi
echo "installing NVIDIA Dynamo $DYNAMO into $V"
uv pip install --quiet --python "$V/bin/python" -r requirements/dynamo.lock
uv pip install --quiet --python "$V/bin/python" --no-deps "ai-dynamo==$DYNAMO"
# NIXL (memory-to-memory transfers through UCX; runs on CPU) for dynamo_deploy.nixl_bench: the nixl-cu12 wheel (its
# dependencies, torch and numpy, are installed already and stay), then the `nixl` module that dynamo.nixl_connect
# imports, without its dependencies (they would add nixl-cu13); optional
uv pip install --quiet --python "$V/bin/python" "nixl-cu12==1.5.1" \
    && uv pip install --quiet --python "$V/bin/python" --no-deps "nixl==1.5.2" \
    || echo "NIXL did not install: hand-overs travel inline (they do anyway; only the benchmark needs it)"
"$V/bin/python" -c 'import numpy, torch, dynamo.runtime; assert numpy.__version__.startswith("1."), numpy.__version__; print(f"dynamo environment ready: torch {torch.__version__}, numpy {numpy.__version__}")'
