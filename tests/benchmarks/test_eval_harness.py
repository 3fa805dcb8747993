"""lm-evaluation-harness scores the served model end to end (benchmarks/eval_harness.py): `local-completions`
(loglikelihood through /v1/completions with echo + logprobs) and `local-chat-completions` (generation through
/v1/chat/completions) on a small local dataset the script writes, and every loglikelihood lm-eval computed equals the
tensor API's teacher forcing of the same tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EVAL_PYTHON = ROOT / ".venv-eval" / "bin" / "python"

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not EVAL_PYTHON.exists(),
                    reason=".venv-eval is missing: bash scripts/setup_eval.sh (scripts/test.sh runs it)")
def test_lm_eval_scores_the_server_on_both_endpoints() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "eval-harness", "--limit", "4"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    results = json.loads(re.search(r"^results: (.*)$", out, re.M).group(1))
    assert 0.0 <= results["mol2_mc"]["acc,none"] <= 1.0 and "exact_match,none" in results["mol2_gen"]
    assert "mol2_mc, 4 items" in out and "mol2_gen, 4 items" in out
    checked = re.search(r"^check: (\d+) loglikelihoods .* \(largest difference (\S+)\)$", out, re.M)
    assert int(checked.group(1)) == 8 and float(checked.group(2)) <= 1e-4, (
        "4 items x 2 choices, each = the tensor API's")
    assert out.count("generated for") == 4
