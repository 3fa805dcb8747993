#!/usr/bin/env bash
# Create (or update) .venv-eval: lm-evaluation-harness (lm-eval 0.4.x with its API extra) for benchmarks/eval_harness.py.
# Why separate: lm-eval pulls datasets, evaluate, accelerate and newer numpy / pyarrow; the serving venv (.venv) pins
# numpy<2 (Triton 2.51's Python backend) and torch==2.13.0, and its tests must not depend on what the harness drags in.
# lm-eval only talks HTTP to the frontend, so nothing of the server runs here. The pinned versions of
# requirements/eval.lock (from requirements/eval.in: lm-eval[api]==0.4.13, transformers as the tokenizer backend;
# regenerate: bash scripts/lock.sh eval) hold torch at 2.13.0+cpu. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/side_venv.sh
side_venv .venv-eval requirements/eval.lock
.venv-eval/bin/python -c 'import lm_eval, importlib.metadata as m; print("evaluation environment ready: lm-eval", m.version("lm-eval"))'
