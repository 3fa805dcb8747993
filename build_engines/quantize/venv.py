"""The quantization venv (`.venv-quant`, ModelOpt + numpy 2): find or create it, and run the PTQ worker in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

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
    if _imports_modelopt(python):
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


def _imports_modelopt(python: Path) -> bool:
    """Whether `python` imports ModelOpt's ONNX quantization. Asked once per interpreter and process (the import
    takes about 5 s; a build's graphs and the builds of one test worker would otherwise pay it each time); a failed
    probe is not remembered, so a venv created afterwards is found."""
    if python in _PROBED:
        return True
    probe = [str(python), "-c", "import modelopt.onnx.quantization"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        _PROBED.add(python)
        return True
    return False


_PROBED: set[Path] = set()


def run_worker(graphs: dict[str, tuple[Path, Path]], mode: str, calib: Path) -> dict[str, dict]:
    """Quantize each graph (name -> (fp32 graph, quantized graph)) with ModelOpt in one process of the quantization
    venv; returns each graph's report. The bar moves as each graph's report line arrives."""
    reports = {name: out.with_suffix(".report.json") for name, (_, out) in graphs.items()}
    cmd = [str(quant_python()), str(WORKER), "--mode", mode, "--calib", str(calib),
           "--graph", *(str(g) for g, _ in graphs.values()), "--out", *(str(o) for _, o in graphs.values()),
           "--report", *(str(r) for r in reports.values())]
    with tempfile.TemporaryFile("w+") as errors, \
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, cwd=PROJECT_ROOT) as worker, \
            tqdm(total=len(graphs), desc=f"ModelOpt {mode} PTQ", unit="graph") as bar:
        assert worker.stdout is not None
        output = []
        for line in worker.stdout:
            output.append(line)
            bar.update(line.startswith("{"))
        code = worker.wait()
        errors.seek(0)
        stderr = errors.read()
    missing = [name for name, r in reports.items() if not r.exists()]
    if code != 0 or missing:
        raise QuantEnvError(f"ModelOpt PTQ of {', '.join(missing) or 'the graphs'} failed ({code}):\n"
                            f"{''.join(output)[-3000:]}\n{stderr[-3000:]}")
    result = {name: json.loads(r.read_text()) for name, r in reports.items()}
    for r in reports.values():
        r.unlink()
    return result
