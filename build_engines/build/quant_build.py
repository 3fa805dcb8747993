"""Quantized ONNX engines: fp32 graphs in, ModelOpt PTQ (calibrated on held-out text) out, checked on other text.

Steps: calibration feeds from the committed held-out `val` text through the fp32 graphs (`quantize/calibration.py`),
ModelOpt ONNX PTQ of the encoder and decoder in the quantization venv (`quantize/ptq_worker.py`), the pointer kept
in fp32 (it is 0.1 MB and runs once per turn), then a check on held-out `test` text: the quantized engines'
perplexity against the fp32 engines' for base text and each adapter on its own domain. Beyond `CHECK_BOUND` the build
fails and nothing is written. With `--kv-quant fp8` the PTQ'd graphs are then rewritten to keep their rings and
global-KV stores in fp8 e4m3, with per-tensor scales from the same calibration run (`quantize/kv_cache.py`), and the
check runs them with fp8 rows.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from onnx import TensorProto
from tqdm import tqdm

from build_engines.build.onnx_build import DRAFTER_FILE, GRAPH_FILES, describe, ort_runner
from build_engines.quantize.calibration import write_calibration
from build_engines.quantize.heldout import load_heldout, token_sequences
from build_engines.quantize.kv_cache import quantize_state, scales_from_amax
from build_engines.quantize.scoring import bundled_adapters, perplexity
from build_engines.quantize.venv import run_worker
from ced.formats.checkpoint import load_config
from ced.formats.drafter_files import drafter_spec
from ced.steps.kv_state import kv_layout, kv_runner
from ced.steps.layout import StepLayout

QUANTIZED = ("encoder", "decoder")
CHECK_BOUND = {"fp8": 0.02, "int8": 0.03}  # relative perplexity change vs fp32 on the check text (issue #13)
# per domain, one sequence: a guard against a broken engine, not the evaluation (benchmarks/quant_accuracy.py)
CHECK_TOKENS = 128
# onnxruntime folds every weight DequantizeLinear into an fp32 constant at load instead of dequantizing it every step
# (by default it keeps them for its QDQ fusions): the Q/DQ graph's arithmetic on fp32 kernels, ~2.5x faster on CPU,
# perplexity within the bounds (docs/quantization.md). The weights are fp32 in memory at run time either way on CPU.
SESSION_CONFIG = {"session.disable_quant_qdq": "1"}


class QuantCheckError(RuntimeError):
    """A quantized engine drifts from the fp32 engine beyond the bound."""


def build_quantized(model_dir: Path, fp32_dir: Path, fp32_graphs: dict[str, Any], out: Path, mode: str,
                    data_dir: Path | None = None, kv_quant: str = "none") -> tuple[dict[str, Any], dict[str, Any]]:
    """Quantize the fp32 graphs in `fp32_dir` (described by `fp32_graphs`) into `out`; returns (graph descriptions,
    the manifest's `quant` section)."""
    import onnx

    cfg = load_config(model_dir)
    layout = StepLayout(cfg, drafter_spec(model_dir) if "drafter" in fp32_graphs else None)
    fp32 = {name: ort_runner(fp32_dir / GRAPH_FILES[name]) for name in QUANTIZED}
    adapters = bundled_adapters(model_dir, layout)
    val = load_heldout(model_dir, "val", data_dir)
    calib_dir = out / ".calibration"
    t0 = time.time()
    calib = write_calibration(calib_dir, layout, fp32["encoder"], fp32["decoder"], val, model_dir / "tokenizer.json",
                              adapters)
    calib_seconds = time.time() - t0
    try:
        reports = run_worker({name: (fp32_dir / GRAPH_FILES[name], out / GRAPH_FILES[name]) for name in QUANTIZED},
                             mode, calib_dir)
    finally:
        shutil.rmtree(calib_dir, ignore_errors=True)
    kv_cache = None
    if kv_quant == "fp8":
        scales = scales_from_amax(layout, calib.amax)
        added = {name: quantize_state(out / GRAPH_FILES[name], name, layout, scales) for name in QUANTIZED}
        kv_cache = {"format": "FLOAT8E4M3FN", "scales": scales.describe(),
                    "amax": {"encoder_rings": calib.amax.encoder_rings.tolist(),
                             "decoder_rings": calib.amax.decoder_rings.tolist(),
                             "stores": {str(k): v for k, v in calib.amax.stores.items()}},
                    "scale_rule": "per tensor (per ring layer, per global-KV source): max |x| over the calibration "
                                  "run / 448",
                    "state": "window rings (encoder and decoder) and global-KV stores (with the decoder's mirror) in "
                             "fp8; index keys, pending pairs and hand-over rows fp32",
                    "qdq_added": added}
    shutil.copyfile(fp32_dir / GRAPH_FILES["pointer"], out / GRAPH_FILES["pointer"])
    ios = {"encoder": (layout.encoder_inputs(), layout.encoder_outputs()),
           "decoder": (layout.decoder_inputs(), layout.decoder_outputs())}
    graphs = {"pointer": {**fp32_graphs["pointer"], "quantized": False}}  # the same file, copied
    if "drafter" in fp32_graphs:  # the drafter proposes, the quantized target decides: it stays fp32, copied
        shutil.copyfile(fp32_dir / DRAFTER_FILE, out / DRAFTER_FILE)
        graphs["drafter"] = {**fp32_graphs["drafter"], "quantized": False}
    for name in QUANTIZED:
        path = out / GRAPH_FILES[name]
        model = onnx.load(str(path))
        graphs[name] = {**fp8_dtypes(describe(model, path, *ios[name]), model), "quantized": True}
    check = check_quantized(model_dir, fp32, out, layout, adapters, mode, data_dir, kv_cache)
    quant = {
        "mode": mode,
        "method": "ModelOpt ONNX PTQ (modelopt.onnx.quantization.quantize) of every weight MatMul/Gemm of the encoder "
                  "and decoder graphs; activations per tensor, weights per channel (int8) / per tensor (fp8); LoRA "
                  "products, attention products and the pointer graph stay fp32; mol2 local functions inlined",
        "calibration": {**val.describe(), **calib.describe(), "seconds": round(calib_seconds, 1)},
        "graphs": reports,
        "check": check,
        "session_config": SESSION_CONFIG,
        **({"kv_cache": kv_cache} if kv_cache else {}),
    }
    return graphs, quant


def fp8_dtypes(description: dict[str, Any], model: Any) -> dict[str, Any]:
    """The graph's inputs/outputs as described, with the element type the graph really has for fp8 state tensors."""
    fp8 = {v.name for v in list(model.graph.input) + list(model.graph.output)
           if v.type.tensor_type.elem_type == TensorProto.FLOAT8E4M3FN}
    for key in ("inputs", "outputs"):
        description[key] = [{**t, "dtype": "float8e4m3fn"} if t["name"] in fp8 else t for t in description[key]]
    return description


def check_quantized(model_dir: Path, fp32: dict, out: Path, layout: StepLayout, adapters, mode: str,  # type: ignore[no-untyped-def]
                    data_dir: Path | None, kv_cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """Perplexity of fp32 and quantized engines on held-out `test` text: base on base text, each adapter on its domain
    (the quantized engines with the rows they are served with: fp8 state when `kv_cache`)."""
    test = load_heldout(model_dir, "test", data_dir)
    sequences = token_sequences(test, model_dir / "tokenizer.json", CHECK_TOKENS, 1)
    quant = {name: kv_runner(out / GRAPH_FILES[name], SESSION_CONFIG) for name in QUANTIZED}  # as the engine runs them
    qlayout = kv_layout(layout.cfg, {"quant": {"kv_cache": kv_cache}} if kv_cache else None)
    figures = {}
    for kind, seqs in tqdm(sequences.items(), desc="checking perplexity", unit="domain", leave=False):
        slot = adapters.slot_of_kind.get(kind, 0)
        a = perplexity(layout, fp32["encoder"], fp32["decoder"], adapters.bank, seqs, slot)
        b = perplexity(qlayout, quant["encoder"], quant["decoder"], adapters.bank, seqs, slot)
        figures[f"{kind}/{adapters.name_of_slot[slot]}"] = {"fp32": round(a, 4), mode: round(b, 4),
                                                            "relative": round(b / a - 1, 5)}
    worst = max(abs(f["relative"]) for f in figures.values())
    result = {"text": test.describe(), "tokens_per_domain": CHECK_TOKENS, "perplexity": figures,
              "worst_relative": worst, "bound": CHECK_BOUND[mode]}
    if worst > CHECK_BOUND[mode]:
        raise QuantCheckError(f"{mode} engines' perplexity differs from fp32 by {worst:.2%} "
                              f"(> {CHECK_BOUND[mode]:.0%}): {figures}")
    return result
