"""The quantization venv (`.venv-quant`, ModelOpt + numpy 2): find or create it, and run the PTQ worker in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
QUANT_VENV = PROJECT_ROOT / ".venv-quant"
SETUP = PROJECT_ROOT / "scripts" / "setup_quant.sh"
WORKER = Path(__file__).resolve().parent / "ptq_worker.py"


class QuantEnvError(RuntimeError):
    """The quantization venv could not be created or the worker failed; the message carries its output."""


def quant_python() -> Path:
    """The interpreter of the quantization venv (MOL2_QUANT_PYTHON overrides), created on first use."""
    override = os.environ.get("MOL2_QUANT_PYTHON")
    python = Path(override) if override else QUANT_VENV / "bin" / "python"
    probe = [str(python), "-c", "import modelopt.onnx.quantization"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    if override:
        raise QuantEnvError(f"MOL2_QUANT_PYTHON={override} cannot import modelopt.onnx.quantization")
    print(f"creating the quantization venv {QUANT_VENV} (bash {SETUP.relative_to(PROJECT_ROOT)}; ModelOpt needs "
          f"numpy 2, kept out of .venv)", file=sys.stderr, flush=True)
    t0 = time.time()
    done = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True)
    if done.returncode != 0:
        raise QuantEnvError(f"{SETUP.name} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    print(f"{done.stdout.strip()} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return python


def run_worker(graph: Path, out: Path, mode: str, calib: Path) -> dict:
    """Quantize `graph` into `out` with ModelOpt in the quantization venv; returns the worker's report."""
    report = out.with_suffix(".report.json")
    cmd = [str(quant_python()), str(WORKER), "--graph", str(graph), "--out", str(out), "--mode", mode,
           "--calib", str(calib), "--report", str(report)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=PROJECT_ROOT)
    if done.returncode != 0 or not report.exists():
        raise QuantEnvError(f"ModelOpt PTQ of {graph.name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                            f"{done.stderr[-3000:]}")
    result = json.loads(report.read_text())
    report.unlink()
    return result
