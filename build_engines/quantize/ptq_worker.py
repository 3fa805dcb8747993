"""ModelOpt ONNX post-training quantization of exported graphs; runs inside the quantization venv.

    .venv-quant/bin/python build_engines/quantize/ptq_worker.py --graph encoder.onnx decoder.onnx \
        --out qe.onnx qd.onnx --mode fp8 --calib DIR --report re.json rd.json

Several graphs in one process: importing ModelOpt (and torch beneath it) costs about 5 s, once per worker. Each
graph's report is written, and printed as one JSON line, as soon as it is quantized (the build's progress bar).

Why a separate process and venv: ModelOpt 0.47 needs numpy 2, which corrupts tensors in Triton's Python backend, so
the serving venv keeps numpy 1 and this file is run as a script by the quantization venv's interpreter (it imports
only onnx, numpy, onnxruntime, modelopt and its sibling `qdq.py`, never the project package).

Why ModelOpt's ONNX PTQ and not `mtq.quantize` on the step modules: the step modules multiply by weights
functionally (`x @ W.t()`, experts as concatenated tensors), so ModelOpt's module replacement (QuantLinear) finds
nothing to wrap. On the exported graph every weight product is a MatMul with an initializer operand, which
`modelopt.onnx.quantization.quantize` calibrates (onnxruntime CPU) and wraps in standard Q/DQ. The `mol2` nodes are
inlined first: ModelOpt's graph rewriting drops the model's local functions, and onnxruntime inlines them anyway.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
from qdq import qdq_summary, rewrite_trt_qdq, weight_matmuls

CALIBRATION_METHOD = {"fp8": "max", "int8": "max"}  # amax of each activation over the calibration set


class NpzReader:
    """An onnxruntime CalibrationDataReader over `<prefix>_*.npz` feeds (their shapes differ, so no stacking)."""

    def __init__(self, files: list[Path], names: list[str], shared: dict[str, np.ndarray]) -> None:
        self.files, self.names, self.shared, self.i = files, names, shared, 0

    def _feed(self, i: int) -> dict[str, np.ndarray]:
        with np.load(self.files[i]) as data:
            return {n: data[n] if n in data else self.shared[n] for n in self.names}

    def get_first(self) -> dict[str, np.ndarray]:
        """ModelOpt reads one feed ahead to infer shapes; this does not advance the reader."""
        return self._feed(0)

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(self.files):
            return None
        self.i += 1
        return self._feed(self.i - 1)

    def rewind(self) -> None:
        self.i = 0


def inline_mol2(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with every local function expanded into standard ops and no custom opset left."""
    model = onnx.inliner.inline_local_functions(model)
    del model.functions[:]
    keep = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return model


def exact(names: list[str]) -> list[str]:
    """ModelOpt reads node names as regular expressions matched at the start (`node_matmul_3` would also pick
    `node_matmul_30`, a LoRA product): anchor them."""
    return [f"^{re.escape(n)}$" for n in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", type=Path, nargs="+", required=True)
    p.add_argument("--out", type=Path, nargs="+", required=True, help="one per --graph, in the same order")
    p.add_argument("--mode", choices=sorted(CALIBRATION_METHOD), required=True)
    p.add_argument("--calib", type=Path, required=True,
                   help="directory of <name>_NNN.npz calibration feeds (+ <name>_shared.npz)")
    p.add_argument("--report", type=Path, nargs="+", required=True, help="one per --graph, in the same order")
    args = p.parse_args(argv)
    if not len(args.graph) == len(args.out) == len(args.report):
        p.error(f"--graph, --out and --report need one value each per graph: got {len(args.graph)}, "
                f"{len(args.out)} and {len(args.report)}")
    for graph, out, report in zip(args.graph, args.out, args.report):
        quantize_graph(graph, out, args.mode, args.calib, report)
    return 0


def quantize_graph(graph: Path, out: Path, mode: str, calib: Path, report_path: Path) -> None:
    """Quantize `graph` into `out` (ModelOpt PTQ calibrated on `calib`'s feeds of it) and write its report."""
    from importlib.metadata import version

    import modelopt.onnx.quantization as moq
    from onnxruntime.quantization.calibrate import CalibrationDataReader

    t0 = time.time()
    model = inline_mol2(onnx.load(str(graph)))
    nodes = weight_matmuls(model)
    others = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.name not in set(nodes)]
    inlined = out.with_suffix(".inlined.onnx")
    onnx.save(model, str(inlined))
    names = [i.name for i in model.graph.input]
    files = sorted(calib.glob(f"{graph.stem}_[0-9]*.npz"))
    shared_path = calib / f"{graph.stem}_shared.npz"
    shared = dict(np.load(shared_path)) if shared_path.exists() else {}
    if not files:
        raise SystemExit(f"no calibration feeds {graph.stem}_*.npz in {calib}")
    reader = type("Reader", (NpzReader, CalibrationDataReader), {})(files, names, shared)
    moq.quantize(str(inlined), quantize_mode=mode, calibration_data_reader=reader,
                 calibration_method=CALIBRATION_METHOD[mode], calibration_eps=["cpu"], high_precision_dtype="fp32",
                 op_types_to_quantize=["MatMul", "Gemm"], nodes_to_quantize=exact(nodes),
                 nodes_to_exclude=exact(others), dq_only=True, output_path=str(out), log_level="WARNING")
    inlined.unlink()
    quantized = onnx.load(str(out))
    rewritten = rewrite_trt_qdq(quantized)
    summary = qdq_summary(quantized)
    if summary["custom_domains"]:
        raise SystemExit(f"the quantized graph still has non-standard domains {summary['custom_domains']}")
    onnx.checker.check_model(quantized)
    onnx.save(quantized, str(out))
    report = {
        "tool": "modelopt.onnx.quantization.quantize", "modelopt": version("nvidia-modelopt"), "numpy": np.__version__,
        "mode": mode, "calibration_method": CALIBRATION_METHOD[mode], "calibration_feeds": len(files),
        "weight_matmuls": len(nodes), "fp32_matmuls": len(others), "trt_nodes_rewritten": rewritten, **summary,
        "seconds": round(time.time() - t0, 1),
    }
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main())
