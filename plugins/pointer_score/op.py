"""`torch.ops.mol2.pointer_score` and the call the router uses (see plugins/op_wrapper.py)."""

from __future__ import annotations

import torch

from plugins.op_wrapper import cuda_kernel_or_reference, exporting, needs_grad, symbolic
from plugins.pointer_score.reference import pointer_score_reference

OP_TYPE = "PointerScore"


@torch.library.custom_op("mol2::pointer_score", mutates_args=(), device_types="cpu")
def _op(x: torch.Tensor, xn: torch.Tensor, attn_query: torch.Tensor, attn_bias: torch.Tensor, point_query: torch.Tensor,
        point_read: torch.Tensor, point_bias: torch.Tensor, option_mask: torch.Tensor, heads: int) -> torch.Tensor:
    return pointer_score_reference(x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask,
                                   heads)


_op.register_kernel("cuda")(cuda_kernel_or_reference("plugins.pointer_score.kernel", "pointer_score_triton",
                                                     pointer_score_reference))


@_op.register_fake
def _(x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask, heads):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], point_query.shape[1])


def pointer_score(x: torch.Tensor, xn: torch.Tensor, attn_query: torch.Tensor, attn_bias: torch.Tensor,
                  point_query: torch.Tensor, point_read: torch.Tensor, point_bias: torch.Tensor,
                  option_mask: torch.Tensor, heads: int) -> torch.Tensor:
    """See reference.py for shapes. One `mol2::PointerScore` node when exporting."""
    args = (x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask)
    if exporting():
        return symbolic(OP_TYPE, args, {"heads": int(heads)}, x, shape=(x.shape[0], point_query.shape[1]))
    if needs_grad(x, xn, attn_query, attn_bias, point_query, point_read, point_bias):
        return pointer_score_reference(*args, heads)
    return torch.ops.mol2.pointer_score(*args, int(heads))
