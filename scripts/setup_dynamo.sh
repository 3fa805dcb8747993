#!/usr/bin/env bash
# Create (or update) .venv-dynamo: NVIDIA Dynamo (runtime + OpenAI frontend) and this project, for the scale-out
# deployment (dynamo_deploy/, docs/scale_out.md). Its own venv because ai-dynamo-runtime pins pydantic<=2.13.5 while
# the main .venv carries a newer one, and transformers (an ai-dynamo dependency) must not move the main venv's
# tokenizers. torch==2.13.0 (CPU) goes in first so transformers never pulls a CUDA build; numpy stays <2.
# ai-dynamo is installed without its dependencies: one of them (aisimulate, used only by Dynamo's planner) downloads
# from outside the package registries; the others are listed here (pip then warns that aisimulate is missing: expected).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
V="${DYNAMO_VENV:-.venv-dynamo}"
DYNAMO=1.6.1
[ -x $V/bin/python ] || "$PY" -m venv $V
if $V/bin/python -c "import dynamo.runtime, dynamo.frontend, dynamo_deploy, tritonserver_backend, nixl, xgrammar" 2>/dev/null; then
    echo "dynamo environment ready ($V)"; exit 0
fi
echo "installing NVIDIA Dynamo $DYNAMO into $V (about a minute)"
$V/bin/python -m pip install --quiet --upgrade pip >/dev/null
$V/bin/python -m pip install --quiet "torch==2.13.0" "numpy>=1.24,<2"
$V/bin/python -m pip install --quiet "ai-dynamo-runtime==$DYNAMO"
$V/bin/python -m pip install --quiet --no-deps "ai-dynamo==$DYNAMO"
$V/bin/python -m pip install --quiet "aiohttp>=3.14.3,<4" "certifi>=2026.10.19" "kubernetes>=32.0.1,<33" "msgspec>=0.19" \
    "prometheus-client>=0.23.1,<1" "pyzmq>=26" "redis>=6.2,<9" "tqdm>=4" "transformers>=4.56" "typing-extensions>=4.10" \
    "zstandard>=0.23,<1" "pytest>=8,<10" "numpy>=1.24,<2" "torch==2.13.0"
$V/bin/python -m pip install --quiet -e ".[dynamo]" "numpy>=1.24,<2" "torch==2.13.0"
# NIXL (memory-to-memory transfers through UCX; runs on CPU) for dynamo_deploy.nixl_bench: the nixl-cu12 wheel, then the
# `nixl` module that dynamo.nixl_connect imports, without its dependencies (they would add nixl-cu13); optional
$V/bin/python -m pip install --quiet "nixl-cu12==1.5.1" && $V/bin/python -m pip install --quiet --no-deps "nixl==1.5.2" \
    || echo "NIXL did not install: hand-overs travel inline (they do anyway; only the benchmark needs it)"
$V/bin/python -c 'import numpy, torch, dynamo.runtime; assert numpy.__version__.startswith("1."), numpy.__version__; print(f"dynamo environment ready: torch {torch.__version__}, numpy {numpy.__version__}")'
