"""The PTQ worker's command line, as the build calls it (several graphs in one process): a graph without its output
or report path is refused before ModelOpt is imported, by name of what is missing."""

from __future__ import annotations

import subprocess

from build_engines.quantize.venv import WORKER, quant_python


def test_each_graph_needs_its_output_and_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cmd = [str(quant_python()), str(WORKER), "--mode", "fp8", "--calib", str(tmp_path),
           "--graph", "encoder.onnx", "decoder.onnx", "--out", "e.onnx", "--report", "e.json", "d.json"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=WORKER.parent)
    assert done.returncode == 2
    assert "--graph, --out and --report need one value each per graph: got 2, 1 and 2" in done.stderr
    assert not list(tmp_path.iterdir())
