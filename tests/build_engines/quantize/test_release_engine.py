"""`--quant release`: a synthetic released-format checkpoint (fp8 32x32-block linears with ue8m0 scales, packed fp4
routed experts) built into ONNX engines that store those weights as released and dequantize them in the graph; the
engine's logits against the fp32 reference network of the same checkpoint."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from build_engines.build.cli import main as build
from build_engines.build.onnx_build import GRAPH_FILES, random_bank
from build_engines.quantize.release_weights import match_initializers, stored_weights
from ced.formats.checkpoint import (
    dequantize_tensors,
    load_checkpoint,
    read_raw_tensors,
    write_synthetic_release,
)
from ced.steps.layout import StepLayout
from ced.steps.parity import HANDOVER
from ced.steps.rows import (
    DecoderRow,
    EncoderRow,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)
from tests.tiny import tiny_config

pytestmark = pytest.mark.slow
LOGIT_BOUND = 1e-4  # engine vs the fp32 reference network: the converter's step-module bound (docs/engines.md)
LENGTH, FIRST_CHUNK = 160, 137
# Fixed, unlike most tests here: random tiny weights give near-equal index scores (ReLU scores near 0), and in about one
# seed in tens a top-k selection flips between the fp32 reference (one pass) and the engine (chunked prefill,
# onnxruntime kernels), moving that position's logits by ~5e-3 (seen once in CI, Dec 2). This seed has no such flip, so
# the strict bound checks the stored-bytes engine exactly; a wrong scale or weight moves the logits by far more.
SEED = 1606449332  # more than a window (128): rings wrap, global entries are read; odd first chunk


@pytest.fixture(scope="module")
def release(tmp_path_factory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("release")
    seed = SEED
    print(f"synthetic release checkpoint seed {seed}")
    ckpt = write_synthetic_release(tiny_config(), root / "ckpt", seed=seed)
    out = root / "engines"
    assert build(["--model", str(ckpt), "--out", str(out), "--quant", "release"]) == 0
    return ckpt, out, json.loads((out / "manifest.json").read_text())


def test_the_engine_stores_the_released_bytes_and_no_fp32_copy(release) -> None:  # type: ignore[no-untyped-def]
    ckpt, out, manifest = release
    raw = read_raw_tensors(ckpt)
    dequantized, _ = dequantize_tensors(raw)
    weights = stored_weights(raw, dequantized)
    assert {w.kind for w in weights.values()} == {"fp8", "fp4"}
    assert manifest["settings"]["quant"] == "release" and manifest["quant"]["session_config"]
    stored, blocked_dq = set(), 0
    for name in ("encoder", "decoder"):
        model = onnx.load(str(out / GRAPH_FILES[name]))
        inits = {t.name: t for t in model.graph.initializer}
        for w in weights.values():
            key = f"{w.name}.fp8" if w.kind == "fp8" else f"{w.name}.fp4_packed"
            if key in inits:
                want = TensorProto.FLOAT8E4M3FN if w.kind == "fp8" else TensorProto.UINT8
                assert inits[key].data_type == want
                assert inits[key].raw_data == w.data.contiguous().view(torch.uint8).numpy().tobytes(), (
                    f"{w.name}: the release's bytes")
                assert (inits[f"{w.name}.scale_e8m0"].raw_data
                        == w.scale.contiguous().view(torch.uint8).numpy().tobytes())
                stored.add(w.name)
        assert match_initializers(model, weights) == [], (
            f"{name}: no float initializer holds a stored weight in any layout")
        blocked_dq += sum(1 for n in model.graph.node if n.op_type == "DequantizeLinear"
                          and any(a.name == "block_size" and a.i == 32 for a in n.attribute))
        assert next(o.version for o in model.opset_import if o.domain == "") == 21
        assert any(n.domain == "mol2" for n in model.graph.node), "the mol2 nodes stay (TensorRT maps them to plugins)"
    assert stored == set(weights), "every fp8/fp4 tensor of the checkpoint is stored in an engine"
    assert blocked_dq == sum(1 for w in weights.values() if w.kind == "fp8")
    reports = manifest["quant"]["graphs"]
    stored_bytes = sum(r["stored_bytes"] for r in reports.values())
    assert stored_bytes < 0.3 * manifest["quant"]["fp32_bytes_of_stored_weights"]
    for name, check in manifest["quant"]["check_vs_fp32_graphs"].items():
        print(name, check)
        assert check["bitwise_equal"] and check["max_abs_unfolded"] <= 1e-4


@torch.no_grad()
def test_logits_match_the_fp32_reference_of_the_same_checkpoint(release) -> None:  # type: ignore[no-untyped-def]
    """Every position's next-token logits through the serving engine (`open_engine`, which applies the manifest's
    session config: a chunked prefill, then the decoder one hand-over row at a time, so no bounded replay is involved)
    against the fp32 reference network (the loader's dequantized weights) run over the whole sequence."""
    from tritonserver_backend.engines import open_engine

    ckpt, out, _ = release
    net = load_checkpoint(ckpt)
    layout = StepLayout(net.cfg)
    tokens = np.random.default_rng(SEED).integers(0, net.cfg.vocab_size, (1, LENGTH))
    want = net(torch.from_numpy(tokens)).logits[0].numpy()
    engine = open_engine("onnx", ckpt, out)
    engine.set_lora_bank(random_bank(layout, slots=1, rank=4))  # slot 0: the base (zeros)
    erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
    handover = []
    for lo, hi in ((0, FIRST_CHUNK), (FIRST_CHUNK, LENGTH)):
        step = engine.encoder(encoder_inputs(layout, [erow], tokens[:, lo:hi]))
        absorb_encoder(layout, [erow], step, hi - lo)
        handover.append(step)
    got = []
    for t in range(LENGTH):
        source, i = (handover[0], t) if t < FIRST_CHUNK else (handover[1], t - FIRST_CHUNK)
        row = {k: source[k][0, i:i + 1] for k in HANDOVER}
        drow.absorb(layout, row)
        feed = decoder_inputs(layout, [drow], [{k: row[k] for k in HANDOVER[:4]}], [0])
        result = engine.decoder(feed)
        absorb_decoder([drow], result, feed, False, [0])
        got.append(result["logits"][0])
    diff = float(np.abs(np.stack(got) - want).max())
    print(f"release engine vs fp32 reference network: max abs logit difference {diff:.3g} over {LENGTH} positions "
          f"(largest logit {float(np.abs(want).max()):.3g})")
    assert diff <= LOGIT_BOUND
    assert np.array_equal(np.stack(got).argmax(-1), want.argmax(-1))


def test_a_checkpoint_without_stored_fp8_or_fp4_weights_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ced.formats.checkpoint import save_checkpoint
    from tests.tiny import tiny_network

    ckpt = save_checkpoint(tiny_network(), tmp_path / "plain")
    assert build(["--model", str(ckpt), "--out", str(tmp_path / "out"), "--quant", "release"]) == 1
    assert not (tmp_path / "out" / "manifest.json").exists()
