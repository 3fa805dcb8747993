#!/usr/bin/env bash
# The README's main command: set up the environment, then run the main job on the embedded default.
# Only .venv: the main job serves through tritonserver and never uses NVIDIA Dynamo (scripts/setup_dynamo.sh installs
# .venv-dynamo, 2 GB, for the scale-out deployment and the tests; scripts/test.sh runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --main-only
exec .venv/bin/python scripts/run_main.py "$@"
