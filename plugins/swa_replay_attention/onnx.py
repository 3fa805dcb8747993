"""ONNX side of SwaReplayAttention: its OpSchema and its local function (one GatherND, then the shared attend nodes)."""

from __future__ import annotations

import onnx
from onnx import AttributeProto

from plugins.onnx_common import FunctionBuilder, register_once, schema
from plugins.sparse_global_attention.onnx import attend_nodes
from plugins.swa_replay_attention.op import OP_TYPE

INPUTS = ("q", "kv", "idx", "sink")


def function(opset: int) -> onnx.FunctionProto:
    fb = FunctionBuilder(OP_TYPE)
    zero = fb.const(0)
    rows = fb.op("Shape", "kv", start=1, end=2)
    safe = fb.op("Min", fb.op("Max", "idx", zero), fb.op("Sub", rows, fb.const(1)))
    keys = fb.op("GatherND", "kv", fb.op("Unsqueeze", safe, fb.const([-1])), batch_dims=1)
    out = attend_nodes(fb, "q", keys, fb.op("GreaterOrEqual", "idx", zero), "sink", fb.attr_const("scale"))
    fb.rename_output(out, "out")
    return fb.function(OP_TYPE, INPUTS, ["out"], ["scale"], opset)


def register_schema() -> None:
    register_once(schema(
        OP_TYPE,
        "Each query attends to the rows its window list names in kv (-1 = none), plus a per-head sink. "
        "See plugins/swa_replay_attention/reference.py.",
        inputs=[("q", "T", "(B,S,H,D) queries"), ("kv", "T", "(B,T,D) ring + chunk"),
                ("idx", "tensor(int64)", "(B,S,W) window rows, -1 = none"), ("sink", "T", "(H,) sink logits")],
        outputs=[("out", "T", "(B,S,H,D)")],
        attributes=[("scale", AttributeProto.FLOAT, "softmax scale")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "floating point")],
    ))
