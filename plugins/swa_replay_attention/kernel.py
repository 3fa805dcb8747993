"""OpenAI Triton kernel of SwaReplayAttention: the row-list attention of SparseGlobalAttention over one key table.

Same program layout and math as plugins/sparse_global_attention/kernel.py (its `attend_rows` body, with the global
table switched off at compile time): grid (cdiv(H, BLOCK_H), B * S), one program per (head block, query position),
the query's W window rows gathered from `kv` by index inside the kernel, -1 = no row, the per-head sink in the
denominator only, fp32 accumulation. Decode (S = 1), prefill chunks and the bounded replay (S = 128) are the same
kernel; only the grid's second axis grows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.sparse_global_attention.kernel import (
    ALIGNED,
    POINTER_TYPES,
    Config,
    attend_rows,
    check_inputs,
    config_for,
    fp32_math,
    on_device,
)


@triton.jit
def swa_replay_attention_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr,  # inputs, in the op's order
                                S, H, D, T, J,  # int32 scalars (TensorRT AOT: the extra args)
                                out_ptr,  # output
                                SCALE: tl.constexpr, FP32_MATH: tl.constexpr, FP32_DOT: tl.constexpr,
                                BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    attend_rows(q_ptr, kv_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, S, H, D, T, 0, J,
                SCALE, False, FP32_MATH, FP32_DOT, BLOCK_H, BLOCK_J, BLOCK_D)


def launch(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float, out: torch.Tensor,
           config: Config | None = None) -> torch.Tensor:
    """Run the kernel writing into `out` (contiguous, q's shape and dtype)."""
    check_inputs(q, (kv,), idx, sink)
    B, S, H, D = q.shape
    J, T = idx.shape[2], kv.shape[1]
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or not out.is_contiguous() or out.device != q.device:
        raise ValueError("out must be a contiguous tensor like q")
    if out.numel() == 0:
        return out
    if T == 0 or J == 0:
        return out.zero_()
    fp32 = fp32_math(q, kv)
    cfg = config or config_for(H, D, fp32)
    grid = (triton.cdiv(H, cfg.block_h), B * S)
    with on_device(q):
        swa_replay_attention_kernel[grid](
            q.contiguous(), kv.contiguous(), idx.contiguous(), sink.contiguous(), S, H, D, T, J, out,
            SCALE=float(scale), FP32_MATH=fp32, FP32_DOT=cfg.fp32_dot,
            BLOCK_H=cfg.block_h, BLOCK_J=cfg.block_j, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out


def swa_replay_attention_triton(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """Same signature and semantics as `swa_replay_attention_reference` (shapes in reference.py)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return launch(q, kv, idx, sink, scale, out)


def aot_source(dtype: str = "fp32", heads: int = 64, head_dim: int = 512, scale: float | None = None):  # type: ignore[no-untyped-def]
    """The kernel specialised for one TensorRT build: (triton ASTSource, Config). Arguments: q, kv, idx, sink, the
    int32 extra args (S, H, D, T, J), out."""
    from triton.compiler import ASTSource

    ptr = POINTER_TYPES[dtype]
    cfg = config_for(heads, head_dim, dtype == "fp32")
    signature = {"q_ptr": ptr, "kv_ptr": ptr, "idx_ptr": "*i64", "sink_ptr": ptr,
                 "S": "i32", "H": "i32", "D": "i32", "T": "i32", "J": "i32", "out_ptr": ptr}
    constexprs = {"SCALE": float(head_dim ** -0.5 if scale is None else scale), "FP32_MATH": dtype == "fp32",
                  "FP32_DOT": cfg.fp32_dot, "BLOCK_H": cfg.block_h, "BLOCK_J": cfg.block_j, "BLOCK_D": cfg.block_d}
    signature.update({k: "constexpr" for k in constexprs})
    attrs = {(i,): ALIGNED for i in (0, 1, 2, 3, 9)}
    if head_dim % 16 == 0:
        attrs[(6,)] = ALIGNED
    return ASTSource(swa_replay_attention_kernel, signature, constexprs=constexprs, attrs=attrs), cfg
