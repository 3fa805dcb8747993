"""`torch.ops.mol2.swa_replay_attention` and the call the network uses (see plugins/op_wrapper.py)."""

from __future__ import annotations

import torch

from plugins.op_wrapper import cuda_kernel_or_reference, exporting, needs_grad, symbolic
from plugins.swa_replay_attention.reference import swa_replay_attention_reference

OP_TYPE = "SwaReplayAttention"


@torch.library.custom_op("mol2::swa_replay_attention", mutates_args=(), device_types="cpu")
def _op(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    return swa_replay_attention_reference(q, kv, idx, sink, scale)


_op.register_kernel("cuda")(cuda_kernel_or_reference("plugins.swa_replay_attention.kernel",
                                                     "swa_replay_attention_triton", swa_replay_attention_reference))


@_op.register_fake
def _(q, kv, idx, sink, scale):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)


def swa_replay_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """See reference.py for shapes. One `mol2::SwaReplayAttention` node when exporting."""
    if exporting():
        return symbolic(OP_TYPE, (q, kv, idx, sink), {"scale": float(scale)}, q)
    if needs_grad(q, kv, sink):
        return swa_replay_attention_reference(q, kv, idx, sink, scale)
    return torch.ops.mol2.swa_replay_attention(q, kv, idx, sink, float(scale))
