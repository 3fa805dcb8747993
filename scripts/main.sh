#!/usr/bin/env bash
# The README's main command: set up the environment, then run the main job on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/run_main.py "$@"
