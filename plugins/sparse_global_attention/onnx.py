"""ONNX side of SparseGlobalAttention: its OpSchema and its local function made of standard ops.

The function gathers each query's keys from the two tables with GatherND (batch_dims=1) instead of concatenating the
tables: a decode step then touches J rows per query, not the whole global store. The first `window` entries of every
list are rows of the local table (the op's contract, which the reference checks), so they take one gather from it;
only the others are gathered from both tables and chosen with a Where. Gathering every entry from both tables cost
more than the attention's matrix products in a 128-position replay (the Where alone was 23% of the decoder graph's
kernel time); with the window entries read once the graph gives the same bits in less time (docs/load.md).
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, TensorProto

from plugins.onnx_common import FunctionBuilder, register_once, schema
from plugins.sparse_global_attention.op import OP_TYPE

INPUTS = ("q", "local_kv", "global_kv", "idx", "sink")


def attend_nodes(fb: FunctionBuilder, q: str, keys: str, valid: str, sink: str, scale: str) -> str:
    """Nodes of plugins.attention_math.attend: q (B,S,H,D), keys (B,S,J,D), valid (B,S,J) -> (B,S,H,D)."""
    scores = fb.op("Mul", fb.op("MatMul", q, fb.op("Transpose", keys, perm=[0, 1, 3, 2])), scale)
    neg_inf = fb.const(float("-inf"), TensorProto.FLOAT)
    scores = fb.op("Where", fb.op("Unsqueeze", valid, fb.const([2])), scores, neg_inf)
    sink_b = fb.op("Reshape", sink, fb.const([1, 1, -1, 1]))
    peak = fb.op("Max", fb.op("ReduceMax", scores, fb.const([-1]), keepdims=1), sink_b)
    weights = fb.op("Exp", fb.op("Sub", scores, peak))
    denom = fb.op("Add", fb.op("ReduceSum", weights, fb.const([-1]), keepdims=1),
                  fb.op("Exp", fb.op("Sub", sink_b, peak)))
    return fb.op("MatMul", fb.op("Div", weights, denom), keys)  # type: ignore[return-value]


def function(opset: int) -> onnx.FunctionProto:
    fb = FunctionBuilder(OP_TYPE)
    zero, one, last_axis, list_axis = fb.const(0), fb.const(1), fb.const([-1]), fb.const([2])
    local_rows = fb.op("Shape", "local_kv", start=1, end=2)
    global_rows = fb.op("Shape", "global_kv", start=1, end=2)
    last_local = fb.op("Sub", local_rows, one)
    # entries [0, window): rows of local_kv (or -1), one gather
    window = fb.op("Unsqueeze", fb.attr_const("window", AttributeProto.INT), fb.const([0]))
    window_idx = fb.op("Slice", "idx", fb.const([0]), window, list_axis)
    window_i = fb.op("Unsqueeze", fb.op("Min", fb.op("Max", window_idx, zero), last_local), last_axis)
    window_k = fb.op("GatherND", "local_kv", window_i, batch_dims=1)
    # entries [window, J): either table
    safe = fb.op("Max", fb.op("Slice", "idx", window, fb.const([2 ** 62]), list_axis), zero)
    is_local = fb.op("Less", safe, local_rows)
    local_i = fb.op("Unsqueeze", fb.op("Min", safe, last_local), last_axis)
    global_i = fb.op("Min", fb.op("Max", fb.op("Sub", safe, local_rows), zero), fb.op("Sub", global_rows, one))
    local_k = fb.op("GatherND", "local_kv", local_i, batch_dims=1)
    global_k = fb.op("GatherND", "global_kv", fb.op("Unsqueeze", global_i, last_axis), batch_dims=1)
    either_k = fb.op("Where", fb.op("Unsqueeze", is_local, last_axis), local_k, global_k)
    keys = fb.op("Concat", window_k, either_k, axis=2)
    valid = fb.op("GreaterOrEqual", "idx", zero)
    out = attend_nodes(fb, "q", keys, valid, "sink", fb.attr_const("scale"))
    fb.rename_output(out, "out")
    return fb.function(OP_TYPE, INPUTS, ["out"], ["scale", "window"], opset)


def register_schema() -> None:
    register_once(schema(
        OP_TYPE,
        "Each query attends to the rows its index list names in [local_kv ; global_kv] (-1 = none), plus a per-head "
        "sink in the softmax denominator. K = V (one shared latent). The first `window` entries of every list are rows "
        "of local_kv (or -1). See plugins/sparse_global_attention/reference.py.",
        inputs=[("q", "T", "(B,S,H,D) queries"), ("local_kv", "T", "(B,Tl,D) local table"),
                ("global_kv", "T", "(B,Tg,D) global table"), ("idx", "tensor(int64)", "(B,S,J) rows, -1 = none"),
                ("sink", "T", "(H,) sink logits")],
        outputs=[("out", "T", "(B,S,H,D)")],
        attributes=[("scale", AttributeProto.FLOAT, "softmax scale"),
                    ("window", AttributeProto.INT, "leading entries of every list that index local_kv only (0: none)")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "floating point")],
    ))
