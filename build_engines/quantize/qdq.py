"""Q/DQ nodes that onnxruntime's CPU provider runs: rewrite TensorRT-domain fp8 nodes, and check what a graph holds.

Why: ModelOpt's torch export (and older ONNX flows) write fp8 quantization as `trt::TRT_FP8QuantizeLinear` /
`trt::TRT_FP8DequantizeLinear`, which only TensorRT knows. The standard opset-19 `QuantizeLinear` /
`DequantizeLinear` with a FLOAT8E4M3FN zero point compute the same thing and onnxruntime runs them on CPU.
This module needs only `onnx` and `numpy`, so the quantization venv (numpy 2) and the serving venv (numpy 1) both
import it; the PTQ worker runs it as a sibling file.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import TensorProto, helper

TRT_DOMAIN = "trt"
TRT_TO_STANDARD = {"TRT_FP8QuantizeLinear": "QuantizeLinear", "TRT_FP8DequantizeLinear": "DequantizeLinear",
                   "TRT_INT8QuantizeLinear": "QuantizeLinear", "TRT_INT8DequantizeLinear": "DequantizeLinear"}
FP8_OPSET = 19  # first opset whose QuantizeLinear/DequantizeLinear take float8 zero points


def rewrite_trt_qdq(model: onnx.ModelProto) -> int:
    """Replace TensorRT-domain Q/DQ nodes (in place) by standard ones with a zero point of the right type; returns how
    many were rewritten. A quantize node's output type follows its zero point, so each one gets an explicit zero."""
    count = 0
    for node in model.graph.node:
        if node.domain != TRT_DOMAIN or node.op_type not in TRT_TO_STANDARD:
            continue
        fp8 = "FP8" in node.op_type
        zero_name = f"{node.name or node.output[0]}_zero_point"
        zero_type = TensorProto.FLOAT8E4M3FN if fp8 else TensorProto.INT8
        model.graph.initializer.append(helper.make_tensor(zero_name, zero_type, [], [0]))
        inputs = list(node.input[:2]) + [zero_name]
        axis = [a for a in node.attribute if a.name == "axis"]
        node.op_type, node.domain = TRT_TO_STANDARD[node.op_type], ""
        del node.input[:]
        node.input.extend(inputs)
        del node.attribute[:]
        node.attribute.extend(axis)
        count += 1
    if count:
        for opset in model.opset_import:
            if opset.domain in ("", "ai.onnx") and opset.version < FP8_OPSET:
                opset.version = FP8_OPSET
        keep = [o for o in model.opset_import if o.domain != TRT_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep)
    return count


def qdq_summary(model: onnx.ModelProto) -> dict[str, object]:
    """What quantization a graph holds: Q/DQ counts, zero-point/weight element types, any non-standard domains."""
    inits = {t.name: t for t in model.graph.initializer}
    ops = collections.Counter(n.op_type for n in model.graph.node
                              if n.op_type in ("QuantizeLinear", "DequantizeLinear"))
    types: collections.Counter[str] = collections.Counter()
    quantized_weight_bytes = 0
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            t = inits[node.input[0]]
            types[TensorProto.DataType.Name(t.data_type)] += 1
            quantized_weight_bytes += int(np.prod(t.dims))
        if node.op_type == "QuantizeLinear" and len(node.input) > 2 and node.input[2] in inits:
            types["activation:" + TensorProto.DataType.Name(inits[node.input[2]].data_type)] += 1
    domains = sorted({n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return {"quantize_nodes": ops.get("QuantizeLinear", 0), "dequantize_nodes": ops.get("DequantizeLinear", 0),
            "element_types": dict(sorted(types.items())), "quantized_weight_elements": quantized_weight_bytes,
            "custom_domains": domains, "opset": opset}


def weight_matmuls(model: onnx.ModelProto, min_elements: int = 4096) -> list[str]:
    """Names of the MatMul/Gemm nodes that multiply by a weight (an initializer of >= 2 dims and `min_elements`).

    Everything else stays in high precision: activation x activation products (attention scores, the mHC Sinkhorn's
    small constant Gemms) and, above all, the LoRA products, whose factors are graph inputs, not initializers."""
    inits = {t.name: t for t in model.graph.initializer}

    def is_weight(name: str) -> bool:
        t = inits.get(name)
        return t is not None and len(t.dims) >= 2 and int(np.prod(t.dims)) >= min_elements

    return [n.name for n in model.graph.node
            if n.op_type in ("MatMul", "Gemm") and any(is_weight(i) for i in n.input[:2])]

