"""`--quant release`: a released-format checkpoint (fp8 block-scaled linears, packed fp4 experts) into ONNX engines
that store those weights as released and dequantize them in the graph (`quantize/release_weights.py`).

Steps: the fp32 graphs are exported from the loader's dequantized values and checked against their modules as for
`--quant none` (the exporter traces modules with float weights) into a temporary folder inside the engine directory;
each encoder/decoder weight initializer that holds a stored fp8/fp4 tensor is replaced by the stored bytes and the
ops that rebuild it; the rewritten graphs are run against the fp32 graphs on the build's check inputs, opened with the
manifest's session config (dequantization folded at load: must be bit-identical) and with a plain session (DQ every
step: within `UNFOLDED_BOUND`); the temporary fp32 graphs are deleted. The engine directory ends up with no fp32 copy
of any fp8/fp4 weight.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from build_engines.build.onnx_build import GRAPH_FILES, build_onnx, check_cases, describe, ort_runner
from build_engines.quantize.release_weights import (
    BLOCKED_DQ_OPSET,
    SESSION_CONFIG,
    ReleaseWeightError,
    rewrite_graph,
    stored_weights,
)
from ced.formats.checkpoint import dequantize_tensors, load_config, read_raw_tensors
from ced.steps.engram_feed import EngramFeed
from ced.steps.layout import StepLayout
from ced.steps.parity import max_difference

REWRITTEN = ("encoder", "decoder")
RELEASE_BOUND = 0.0  # opened as the manifest says (dequantization folded at load): the fp32 graph's bits exactly
UNFOLDED_BOUND = 1e-4  # a plain onnxruntime session (dequantizing every step): the converter's parity bound


class ReleaseCheckError(RuntimeError):
    """The engine with stored weights computes something else than the fp32 graph of the same checkpoint."""


def build_release(model_dir: Path, out: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Write the engines into `out`; returns (graph descriptions, fp32 parity figures, the manifest's `quant`)."""
    raw = read_raw_tensors(model_dir)
    dequantized, _ = dequantize_tensors(raw)
    weights = stored_weights(raw, dequantized)
    del dequantized
    if not weights:
        raise ReleaseWeightError(f"{model_dir} stores no fp8 or packed fp4 tensor: --quant release needs a "
                                 "released-format checkpoint")
    layout = StepLayout(load_config(model_dir))
    fp32_dir = out / ".fp32"
    try:
        fp32_graphs, parity = build_onnx(model_dir, fp32_dir)
        used: set[str] = set()
        reports, graphs = {}, {}
        ios = {"encoder": (layout.encoder_inputs(), layout.encoder_outputs()),
               "decoder": (layout.decoder_inputs(), layout.decoder_outputs())}
        for name in REWRITTEN:
            model, names, report = rewrite_graph(onnx.load(str(fp32_dir / GRAPH_FILES[name])), weights)
            onnx.checker.check_model(model)
            path = out / GRAPH_FILES[name]
            onnx.save(model, str(path))
            used.update(names)
            reports[name] = report.as_dict()
            graphs[name] = {**describe(model, path, *ios[name]), "quantized": True}
        missing = sorted(set(weights) - used)
        if missing:
            raise ReleaseWeightError(f"stored weights found in no graph initializer: {missing[:8]} "
                                     f"({len(missing)} in all)")
        shutil.copyfile(fp32_dir / GRAPH_FILES["pointer"], out / GRAPH_FILES["pointer"])
        graphs["pointer"] = {**fp32_graphs["pointer"], "quantized": False}
        check = check_against_fp32(layout, fp32_dir, out, EngramFeed.open(model_dir, layout))
    finally:
        shutil.rmtree(fp32_dir, ignore_errors=True)
    quant = {
        "mode": "release",
        "method": "the checkpoint's stored fp8 e4m3 block-scaled (ue8m0) and packed fp4 e2m1 (ue8m0 per 32) weights "
                  "as engine initializers (release bytes), rebuilt in the graph: blocked DequantizeLinear (opset 21) "
                  "for fp8, e2m1 byte table + per-block scale Mul for fp4 (no onnxruntime CPU kernel for FLOAT4E2M1); "
                  "bf16/f32 tensors stay float; activations as the config's runtime fake-quant says (fp8 per 32 at "
                  "every fp8/fp4 GEMM input when on); Engram tables stay in the checkpoint, gathered on the host",
        "graph_opset": BLOCKED_DQ_OPSET,
        # how the onnx engine opens these graphs (tritonserver_backend/engines/onnx_engine.py)
        "session_config": SESSION_CONFIG,
        "graphs": reports,
        "fp32_bytes_of_stored_weights": int(sum(w.values.size * 4 for w in weights.values())),
        "check_vs_fp32_graphs": check,
    }
    return graphs, parity, quant


def _runner(path: Path, config: dict[str, str]):  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda feed: dict(zip(names, session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})))


def check_against_fp32(layout: StepLayout, fp32_dir: Path, out: Path,
                       engram: EngramFeed | None = None) -> dict[str, Any]:
    """The rewritten graphs against the fp32 graphs of the same checkpoint on the converter's check inputs (a second
    prefill chunk; a replay of two sessions under two random adapter slots in one batch), opened as the manifest says
    and with a plain onnxruntime session."""
    fp32 = {n: ort_runner(fp32_dir / GRAPH_FILES[n]) for n in REWRITTEN}
    feeds = check_cases(layout, fp32["encoder"], engram)
    result: dict[str, Any] = {}
    for name in REWRITTEN:
        want = fp32[name](feeds[name])
        folded = _runner(out / GRAPH_FILES[name], SESSION_CONFIG)(feeds[name])
        plain = _runner(out / GRAPH_FILES[name], {})(feeds[name])
        result[name] = {"bitwise_equal": all(np.array_equal(want[k], folded[k]) for k in want),
                        "max_abs": max(max_difference(want, folded).values()),
                        "max_abs_unfolded": max(max_difference(want, plain).values())}
    for name, r in result.items():
        if r["max_abs"] > RELEASE_BOUND or r["max_abs_unfolded"] > UNFOLDED_BOUND:
            raise ReleaseCheckError(f"{name}: the engine with stored weights differs from the fp32 graph: {r} "
                                    f"(bounds {RELEASE_BOUND} folded, {UNFOLDED_BOUND} unfolded)")
    return result
