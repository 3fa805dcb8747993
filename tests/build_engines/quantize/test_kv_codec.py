"""The fp8 state codec the rows use (`export/rows.fp8_encode` / `fp8_decode`) against onnxruntime's own
QuantizeLinear/DequantizeLinear to FLOAT8E4M3FN, and what crosses the Python boundary (uint8 codes as OrtValues).

Why it matters: the hand-over's global_kv leaves the encoder graph as fp32 values on the fp8 grid and the rows keep
its codes; if the Python encoding ever picked another code than the graph's QuantizeLinear, the encoder's store and
the decoder's mirror would hold something the graph never produced."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ced.engine_dir.manifest import BuildSettings
from ced.steps.rows import FP8_MAX, fp8_decode, fp8_encode


def qdq_session():  # type: ignore[no-untyped-def]
    """x -> (codes = QuantizeLinear(x, s), rounded = DequantizeLinear(codes, s));
    codes8 -> DequantizeLinear(codes8, s)."""
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["codes"]),
             helper.make_node("DequantizeLinear", ["codes", "s", "z"], ["rounded"]),
             helper.make_node("DequantizeLinear", ["codes8", "s", "z"], ["decoded"])]
    graph = helper.make_graph(
        nodes, "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("codes8", TensorProto.FLOAT8E4M3FN, ["M"])],
        [helper.make_tensor_value_info("codes", TensorProto.FLOAT8E4M3FN, ["N"]),
         helper.make_tensor_value_info("rounded", TensorProto.FLOAT, ["N"]),
         helper.make_tensor_value_info("decoded", TensorProto.FLOAT, ["M"])],
        [helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("scale", [1.0, 0.008669904433190823, 0.0157972332, 3.7e-5, 11.5])
def test_python_codes_are_the_graphs_codes(scale: float) -> None:
    session = qdq_session()
    rng = np.random.default_rng(0)
    # 254 finite codes (0x7f, 0xff are NaN)
    every_code = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    x = np.concatenate([rng.standard_normal(20000) * FP8_MAX * scale / 4, np.array([0.0, -0.0, 1e9, -1e9]) * scale,
                        fp8_decode(every_code, scale)]).astype(np.float32)
    codes8 = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(every_code, TensorProto.FLOAT8E4M3FN)
    codes, rounded, decoded = session.run(None, {"x": x, "s": np.array(scale, np.float32), "codes8": codes8})
    assert codes.dtype == np.uint8, "fp8 outputs come back to Python as their uint8 codes"
    assert np.array_equal(fp8_encode(rounded, scale), codes), (
        "encoding the graph's rounded values gives the graph's codes")
    assert np.array_equal(fp8_decode(codes, scale).view(np.uint32), rounded.view(np.uint32)), (
        "decode = DequantizeLinear bit for bit")
    assert np.array_equal(fp8_decode(every_code, scale).view(np.uint32), decoded.view(np.uint32))
    assert codes[20000 + 2] == 0x7E and codes[20000 + 3] == 0xFE, "the graph saturates at +-448 (never NaN)"


def test_float8_numpy_arrays_cannot_be_fed_but_uint8_codes_can() -> None:
    """The measured reason the rows keep uint8: onnxruntime 1.32 refuses ml_dtypes' float8 arrays."""
    session = qdq_session()
    x = np.ones(3, np.float32)
    with pytest.raises(RuntimeError, match="can't be converted"):
        session.run(None, {"x": x, "s": np.array(1, np.float32), "codes8": np.ones(2, ml_dtypes.float8_e4m3fn)})
    codes8 = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.array([0x38, 0xB8], np.uint8), TensorProto.FLOAT8E4M3FN)
    assert session.run(["decoded"], {"x": x, "s": np.array(1, np.float32), "codes8": codes8})[0].tolist() == [1.0, -1.0]


def test_builds_without_kv_quant_keep_their_manifest_settings() -> None:
    """fp32 / fp8 / int8 builds without --kv-quant write (and look for) the settings they always did."""
    assert BuildSettings("onnx", "none", 18).as_dict() == {"format": "onnx", "quant": "none", "opset": 18}
    assert BuildSettings("onnx", "fp8", 18, "fp8").as_dict() == {"format": "onnx", "quant": "fp8", "opset": 18,
                                                                 "kv_quant": "fp8"}
