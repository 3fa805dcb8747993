#!/usr/bin/env bash
# The project's test command: set up the environment, then run the whole suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
