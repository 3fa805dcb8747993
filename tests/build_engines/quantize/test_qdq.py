"""Fast checks of the quantized-build plumbing: the TensorRT-domain fp8 rewrite runs in onnxruntime and rounds like
torch's float8_e4m3fn, the weight-product selection leaves LoRA and activation products alone, nvfp4 is refused."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from build_engines.build.cli import main as build
from build_engines.quantize.qdq import qdq_summary, rewrite_trt_qdq, weight_matmuls


def trt_fp8_graph(scale: float) -> onnx.ModelProto:
    """x -> trt::TRT_FP8QuantizeLinear -> trt::TRT_FP8DequantizeLinear -> y, as ModelOpt's torch export writes it."""
    nodes = [helper.make_node("TRT_FP8QuantizeLinear", ["x", "s"], ["q"], domain="trt", name="q"),
             helper.make_node("TRT_FP8DequantizeLinear", ["q", "s"], ["y"], domain="trt", name="dq")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                              [numpy_helper.from_array(np.array(scale, np.float32), "s")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("trt", 1)])


def test_trt_fp8_nodes_become_standard_qdq_that_onnxruntime_runs() -> None:
    scale = 0.05
    model = trt_fp8_graph(scale)
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime refuses the TensorRT domain
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert rewrite_trt_qdq(model) == 2
    onnx.checker.check_model(model)
    summary = qdq_summary(model)
    assert summary["custom_domains"] == [] and summary["opset"] >= 19
    assert summary["quantize_nodes"] == 1 and summary["dequantize_nodes"] == 1
    x = (np.random.default_rng(0).standard_normal((4, 8)) * 3).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    expected = (torch.from_numpy(x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).numpy()
    np.testing.assert_array_equal(y, expected)
    assert not np.array_equal(y, x), "fp8 rounding changes the values (the check is not vacuous)"


def test_only_products_with_a_weight_initializer_are_selected() -> None:
    w = numpy_helper.from_array(np.ones((64, 128), np.float32), "w")
    small = numpy_helper.from_array(np.ones((4, 4), np.float32), "small")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="weight"),
             helper.make_node("MatMul", ["x", "lora_a"], ["b"], name="lora"),
             helper.make_node("MatMul", ["c", "small"], ["d"], name="tiny")]
    graph = helper.make_graph(nodes, "g",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "lora_a", "c")],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "b", "d")],
                              [w, small])
    assert weight_matmuls(helper.make_model(graph)) == ["weight"]


def test_nvfp4_is_refused_on_cpu_naming_the_gpu(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the CPU refusal does not apply")
    assert build(["--model", "embedded/mol2-small", "--out", str(tmp_path / "e"), "--quant", "nvfp4"]) == 2
    err = capsys.readouterr().err
    assert "NVIDIA GPU" in err and "CUDA" in err and "fp8 or int8" in err
    assert not (tmp_path / "e").exists(), "refused before anything was written"
