"""`torch.ops.mol2.sparse_global_attention` and the call the network uses (see plugins/op_wrapper.py)."""

from __future__ import annotations

import torch

from plugins.op_wrapper import cuda_kernel_or_reference, exporting, needs_grad, symbolic
from plugins.sparse_global_attention.reference import sparse_global_attention_reference

OP_TYPE = "SparseGlobalAttention"


@torch.library.custom_op("mol2::sparse_global_attention", mutates_args=(), device_types="cpu")
def _op(q: torch.Tensor, local_kv: torch.Tensor, global_kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
        scale: float, window: int) -> torch.Tensor:
    return sparse_global_attention_reference(q, local_kv, global_kv, idx, sink, scale, window)


_op.register_kernel("cuda")(cuda_kernel_or_reference("plugins.sparse_global_attention.kernel",
                                                     "sparse_global_attention_triton",
                                                     sparse_global_attention_reference))


@_op.register_fake
def _(q, local_kv, global_kv, idx, sink, scale, window):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)


def sparse_global_attention(q: torch.Tensor, local_kv: torch.Tensor, global_kv: torch.Tensor, idx: torch.Tensor,
                            sink: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """See reference.py for shapes and `window`. One `mol2::SparseGlobalAttention` node when exporting."""
    if exporting():
        return symbolic(OP_TYPE, (q, local_kv, global_kv, idx, sink), {"scale": float(scale), "window": int(window)}, q)
    if needs_grad(q, local_kv, global_kv, sink):
        return sparse_global_attention_reference(q, local_kv, global_kv, idx, sink, scale, window)
    return torch.ops.mol2.sparse_global_attention(q, local_kv, global_kv, idx, sink, float(scale), int(window))
