"""The graph rewrite behind `--quant release` on small hand-made graphs: stored fp8 (32x32 and V4's 128x128 blocks,
partial edge blocks) and packed fp4 weights, found as W^T, in a grouped 3-D layout and inside concatenations along
either axis, rebuilt bit for bit by the inserted ops (onnxruntime CPU)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from build_engines.quantize.release_weights import SESSION_CONFIG, ReleaseWeightError, StoredWeight, rewrite_graph
from ced.model.quant_formats import (
    dequantize_fp4_packed,
    dequantize_fp8_blocks,
    quantize_fp4_packed,
    quantize_fp8_blocks,
)


def _fp8(name: str, shape: tuple[int, int], block: tuple[int, int]) -> StoredWeight:
    q, s = quantize_fp8_blocks(torch.randn(shape) * 0.05, block)
    return StoredWeight(name, "fp8", q, s, dequantize_fp8_blocks(q, s, block).numpy())


def _fp4(name: str, shape: tuple[int, int]) -> StoredWeight:
    p, s = quantize_fp4_packed(torch.randn(shape) * 0.05)
    return StoredWeight(name, "fp4", p, s, dequantize_fp4_packed(p, s).numpy())


def _graph(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """y_i = x_i @ weight_i for each named float initializer, and the weights themselves as outputs."""
    nodes, inputs, outputs = [], [], []
    for i, (name, array) in enumerate(weights.items()):
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [3, array.shape[-2]]))
        nodes.append(helper.make_node("MatMul", [f"x{i}", name], [f"out_y{i}"]))
        nodes.append(helper.make_node("Identity", [name], [f"out_w{i}"]))
        outputs += [helper.make_tensor_value_info(f"out_y{i}", TensorProto.FLOAT, [3, array.shape[-1]]),
                    helper.make_tensor_value_info(f"out_w{i}", TensorProto.FLOAT, list(array.shape))]
    graph = helper.make_graph(nodes, "g", inputs, outputs,
                              [numpy_helper.from_array(a.astype(np.float32), n) for n, a in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray], config: dict[str, str]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    for k, v in config.items():
        options.add_session_config_entry(k, v)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feed)


def test_stored_weights_are_found_in_every_layout_and_rebuilt_bit_for_bit(seed: int) -> None:
    ws = {w.name: w for w in [
        _fp8("a.weight", (256, 384), (128, 128)),  # V4-Flash blocks
        _fp8("b.weight", (200, 300), (128, 128)),  # partial edge blocks both ways
        _fp8("c.weight", (64, 96), (32, 32)),  # V4.1 blocks
        _fp8("shared.w1.weight", (32, 64), (32, 32)), _fp4("e0.w1.weight", (32, 64)), _fp4("e1.w1.weight", (32, 64)),
        _fp8("shared.w2.weight", (64, 32), (32, 32)), _fp4("e0.w2.weight", (64, 32)), _fp4("e1.w2.weight", (64, 32)),
        _fp8("wo_a.weight", (64, 128), (32, 32)),
    ]}
    v = {n: w.values for n, w in ws.items()}
    initializers = {
        "t_a": v["a.weight"].T, "t_b": v["b.weight"].T, "c_plain": v["c.weight"],  # W^T and W (W @ used as [K, N])
        # experts along N
        "w13": np.concatenate([v["e0.w1.weight"].T, v["e1.w1.weight"].T, v["shared.w1.weight"].T], 1),
        "w2": np.concatenate([v["e0.w2.weight"].T, v["e1.w2.weight"].T, v["shared.w2.weight"].T], 0),  # experts along K
        "wo_a": v["wo_a.weight"].reshape(2, 32, 128).transpose(0, 2, 1)[0],  # not a whole weight: left alone
        "grouped": v["wo_a.weight"].reshape(2, 32, 128).transpose(0, 2, 1),  # folded view(G, r, -1).transpose(1, 2)
    }
    plain = _graph({k: a for k, a in initializers.items() if a.ndim == 2})
    plain.graph.initializer.append(numpy_helper.from_array(initializers["grouped"].astype(np.float32), "grouped"))
    plain.graph.node.append(helper.make_node("Identity", ["grouped"], ["g_out"]))
    plain.graph.output.append(helper.make_tensor_value_info("g_out", TensorProto.FLOAT, [2, 128, 32]))
    rng = np.random.default_rng(seed)
    feed = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in plain.graph.input}
    want = _run(plain, feed, {})
    rewritten, used, report = rewrite_graph(onnx.load_from_string(plain.SerializeToString()), ws)
    onnx.checker.check_model(rewritten)
    assert set(used) == set(ws) and report.initializers_replaced == 6, report
    left = {t.name for t in rewritten.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims) >= 2}
    assert left == {"wo_a", "release.fp4_pair_table"}, left
    for config in (SESSION_CONFIG, {}):
        got = _run(rewritten, feed, config)
        for a, b in zip(want, got):
            assert np.array_equal(a, b) if config else np.allclose(a, b, rtol=1e-5, atol=1e-5)
    weights_out = _run(rewritten, feed, {})
    assert all(np.array_equal(a, b) for a, b in zip(want[1::2], weights_out[1::2])), "rebuilt weights: the same bits"


def test_identical_stored_weights_are_ambiguous() -> None:
    a = _fp8("a.weight", (64, 64), (32, 32))
    b = StoredWeight("b.weight", "fp8", a.data, a.scale, a.values)
    with pytest.raises(ReleaseWeightError, match="identical values"):
        rewrite_graph(_graph({"t": a.values.T}), {"a.weight": a, "b.weight": b})
