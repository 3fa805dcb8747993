"""ONNX side of PointerScore: its OpSchema and its local function made of standard ops."""

from __future__ import annotations

import onnx
from onnx import AttributeProto, TensorProto

from plugins.onnx_common import FunctionBuilder, register_once, schema
from plugins.pointer_score.op import OP_TYPE

INPUTS = ("x", "xn", "attn_query", "attn_bias", "point_query", "point_read", "point_bias", "option_mask")


def function(opset: int) -> onnx.FunctionProto:
    fb = FunctionBuilder(OP_TYPE)
    heads = fb.op("Reshape", fb.attr_const("heads", AttributeProto.INT), fb.const([1]))
    batch = fb.op("Shape", "option_mask", start=0, end=1)
    n = fb.op("Shape", "option_mask", start=1, end=2)
    total = fb.op("Shape", "attn_bias", start=0, end=1)  # H * L
    length = fb.op("Div", total, heads)  # L = n * T
    tokens = fb.op("Div", length, n)
    scores = fb.op("Add", fb.op("MatMul", "xn", "attn_query"), "attn_bias")
    mask4 = fb.op("Unsqueeze", "option_mask", fb.const([1, 3]))  # (B,1,n,1)
    mask = fb.op("Reshape", fb.op("Expand", mask4, fb.op("Concat", batch, heads, n, tokens, axis=0)),
                 fb.op("Concat", batch, total, axis=0))
    neg_inf = fb.const(float("-inf"), TensorProto.FLOAT)
    scores = fb.op("Where", mask, scores, neg_inf)
    attn = fb.op("Softmax", fb.op("Reshape", scores, fb.op("Concat", batch, heads, length, axis=0)), axis=-1)
    attn = fb.op("Reshape", attn, fb.op("Concat", batch, total, axis=0))
    logits = fb.op("Add", fb.op("Add", fb.op("MatMul", "x", "point_query"), "point_bias"),
                   fb.op("MatMul", attn, "point_read"))
    out = fb.op("Where", "option_mask", logits, neg_inf)
    fb.rename_output(out, "logits")
    return fb.function(OP_TYPE, INPUTS, ["logits"], ["heads"], opset)


def register_schema() -> None:
    register_once(schema(
        OP_TYPE,
        "MoL2 pointer: the request's projected query against the folded option cache, one logit per option, -inf "
        "outside the row's candidate set. See plugins/pointer_score/reference.py.",
        inputs=[("x", "T", "(B,w) query"), ("xn", "T", "(B,w) cross_norm(query)"), ("attn_query", "T", "(w,H*L)"),
                ("attn_bias", "T", "(H*L,)"), ("point_query", "T", "(w,n)"), ("point_read", "T", "(H*L,n)"),
                ("point_bias", "T", "(n,)"), ("option_mask", "tensor(bool)", "(B,n) candidate options")],
        outputs=[("logits", "T", "(B,n)")],
        attributes=[("heads", AttributeProto.INT, "attention heads of the cross-attention")],
        type_constraints=[("T", ["tensor(float)"], "fp32")],
    ))
