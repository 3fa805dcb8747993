"""OpenAI Triton kernel of SparseGlobalAttention (and the row-list attention SwaReplayAttention shares).

Grid: (cdiv(H, BLOCK_H), B * S). Program (hb, r) handles query position r = b * S + s and the heads
hb * BLOCK_H .. hb * BLOCK_H + BLOCK_H - 1. The head block is the fastest-varying grid axis, so the programs of one
query position run side by side and the key rows they share (K = V is one latent for every head) come from L2 after
the first read.

What a program reads: its q block (BLOCK_H x D), the query's index list idx[b, s, :] (J int64) and, for each listed
row, that one key row of D values, gathered inside the kernel from the local table (0 <= idx < Tl) or the global
table (Tl <= idx, clamped to the last row as the reference does); -1 entries load nothing. Nothing else of the
tables is touched, so a decode step costs q + J key rows + the list per query, whatever the store's length.

Math (fp32 throughout): the list is walked in BLOCK_J chunks with an online softmax whose running max starts at the
head's sink logit and whose running denominator starts at exp(sink - sink) = 1, so the sink sits in the denominator
only. A masked entry has score -inf and weight exactly 0; a query whose entries are all masked ends with acc = 0 and
denominator 1, i.e. an exact zero output. Scores and the weighted sum are `tl.dot`s: IEEE fp32 for fp32 inputs (the
reference's numerics, no TF32), the tensor-core path with fp32 accumulation for matching fp16 / bf16 tables.

Block sizes depend on D (and H) only, never on B, S or the table lengths, so a query's result does not depend on the
batch it shares or on how the sequence was chunked (what the engines' bit-for-bit tests rely on).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def attend_rows(q_ptr, local_ptr, global_ptr, idx_ptr, sink_ptr, out_ptr, S, H, D, TL, TG, J,
                SCALE: tl.constexpr, HAS_GLOBAL: tl.constexpr, FP32_MATH: tl.constexpr, FP32_DOT: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    """The body both attention kernels run (contiguous tensors; HAS_GLOBAL=False reads `local_ptr` only)."""
    hb = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)  # query position b * S + s; 64-bit offsets from here on
    b = r // S
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    d_ok = offs_d < D
    q = tl.load(q_ptr + (r * H + offs_h[:, None]) * D + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_MATH:
        q = q.to(tl.float32)
    m = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)  # running max, starts at the sink
    l_sum = tl.full([BLOCK_H], 1.0, tl.float32)  # running denominator: exp(sink - m) with m = sink
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    last = TL + TG - 1
    for j0 in range(0, J, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        rows = tl.load(idx_ptr + r * J + offs_j, mask=offs_j < J, other=-1)
        valid = rows >= 0
        safe = tl.minimum(tl.maximum(rows, 0), last)
        if HAS_GLOBAL:
            is_local = safe < TL
            local_row = tl.where(is_local, safe, 0)
            global_row = tl.where(is_local, 0, safe - TL)
            k_local = tl.load(local_ptr + (b * TL + local_row)[:, None] * D + offs_d[None, :],
                              mask=(valid & is_local)[:, None] & d_ok[None, :], other=0.0)
            k_global = tl.load(global_ptr + (b * TG + global_row)[:, None] * D + offs_d[None, :],
                               mask=(valid & ~is_local)[:, None] & d_ok[None, :], other=0.0)
            # the reference casts global to local's dtype
            k = tl.where(is_local[:, None], k_local, k_global.to(k_local.dtype))
        else:
            k = tl.load(local_ptr + (b * TL + safe)[:, None] * D + offs_d[None, :], mask=valid[:, None] & d_ok[None, :],
                        other=0.0)
        if FP32_MATH:
            k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=FP32_DOT)
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * SCALE, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if FP32_MATH:
            acc = acc * alpha[:, None] + tl.dot(p, k, input_precision=FP32_DOT)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + (r * H + offs_h[:, None]) * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def sparse_global_attention_kernel(q_ptr, local_ptr, global_ptr, idx_ptr, sink_ptr,  # inputs, in the op's order
                                   S, H, D, TL, TG, J,  # int32 scalars (TensorRT AOT: the extra args)
                                   out_ptr,  # output
                                   SCALE: tl.constexpr, FP32_MATH: tl.constexpr, FP32_DOT: tl.constexpr,
                                   BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    attend_rows(q_ptr, local_ptr, global_ptr, idx_ptr, sink_ptr, out_ptr, S, H, D, TL, TG, J,
                SCALE, True, FP32_MATH, FP32_DOT, BLOCK_H, BLOCK_J, BLOCK_D)


# ----------------------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    """Launch configuration of the attention kernels: a function of (H, D, math) only, never of B, S or T."""

    block_h: int
    block_j: int
    block_d: int
    num_warps: int
    num_stages: int
    fp32_dot: str = "ieee"  # fp32 inputs: "ieee" (the reference's numerics) or "tf32" (faster, ~1e-3 relative)


def config_for(heads: int, head_dim: int, fp32: bool = True) -> Config:
    """BLOCK_D covers D (next power of two, >= 16 as `tl.dot` needs); the head block keeps the fp32 accumulator
    (BLOCK_H x BLOCK_D) at <= 8K values. At D = 512 the fp32 path takes 16 rows a step in one stage (64 KB of shared
    memory on sm_90) and the 16-bit path 32 rows in two stages. First choices made without a GPU:
    `benchmarks/device_check.py` times alternatives (docs/kernels.md)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, min(triton.next_power_of_2(heads), 8192 // block_d))
    if block_d >= 256:
        return Config(block_h, 16, block_d, 4, 1) if fp32 else Config(block_h, 32, block_d, 4, 2)
    return Config(block_h, 64 if block_d <= 64 else 32, block_d, 4, 2)


FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def fp32_math(q: torch.Tensor, *tables: torch.Tensor) -> bool:
    """fp32 dots unless q and every table share one 16-bit type (then the tensor-core path, fp32 accumulation)."""
    return q.dtype == torch.float32 or any(t.dtype != q.dtype for t in tables)


def check_inputs(q: torch.Tensor, tables: tuple[torch.Tensor, ...], idx: torch.Tensor, sink: torch.Tensor) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be (B, S, H, D), got {tuple(q.shape)}")
    B, S, H, D = q.shape
    if idx.dtype != torch.int64 or idx.dim() != 3 or tuple(idx.shape[:2]) != (B, S):
        raise ValueError(f"idx must be int64 (B, S, J) = ({B}, {S}, J), got {idx.dtype} {tuple(idx.shape)}")
    for t in tables:
        if t.dim() != 3 or t.shape[0] != B or t.shape[2] != D:
            raise ValueError(f"key tables must be (B, T, D) = ({B}, T, {D}), got {tuple(t.shape)}")
    if tuple(sink.shape) != (H,):
        raise ValueError(f"sink must be (H,) = ({H},), got {tuple(sink.shape)}")
    if q.dtype not in FLOAT_TYPES or sink.dtype not in FLOAT_TYPES or any(t.dtype not in FLOAT_TYPES for t in tables):
        raise ValueError("q, the key tables and sink must be float32, float16 or bfloat16")
    devices = {t.device for t in (q, idx, sink, *tables)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:  # type: ignore[type-arg]
    """Launch on the tensor's GPU (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------- launch


def launch(q: torch.Tensor, local_kv: torch.Tensor, global_kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
           scale: float, out: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """Run the kernel writing into `out` (contiguous, q's shape and dtype); inputs are made contiguous (a no-op when
    they are). Used by the public function and by the TensorRT plugin's `impl` (which owns `out`)."""
    check_inputs(q, (local_kv, global_kv), idx, sink)
    B, S, H, D = q.shape
    J, Tl, Tg = idx.shape[2], local_kv.shape[1], global_kv.shape[1]
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or not out.is_contiguous() or out.device != q.device:
        raise ValueError("out must be a contiguous tensor like q")
    if out.numel() == 0:
        return out
    if Tl + Tg == 0 or J == 0:  # nothing can be listed: every query sees only its sink
        return out.zero_()
    fp32 = fp32_math(q, local_kv, global_kv)
    cfg = config or config_for(H, D, fp32)
    grid = (triton.cdiv(H, cfg.block_h), B * S)
    with on_device(q):
        sparse_global_attention_kernel[grid](
            q.contiguous(), local_kv.contiguous(), global_kv.contiguous(), idx.contiguous(), sink.contiguous(),
            S, H, D, Tl, Tg, J, out,
            SCALE=float(scale), FP32_MATH=fp32, FP32_DOT=cfg.fp32_dot,
            BLOCK_H=cfg.block_h, BLOCK_J=cfg.block_j, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out


def sparse_global_attention_triton(q: torch.Tensor, local_kv: torch.Tensor, global_kv: torch.Tensor, idx: torch.Tensor,
                                   sink: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """Same signature and semantics as `sparse_global_attention_reference` (shapes in reference.py). `window` needs
    nothing here: the kernel picks each listed row's table inside the loop, at no extra memory traffic."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return launch(q, local_kv, global_kv, idx, sink, scale, out)


# ----------------------------------------------------------------------------------------------- ahead of time

POINTER_TYPES = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}
ALIGNED = [["tt.divisibility", 16]]  # TensorRT's buffers are 256-byte aligned; lets loads vectorise


def aot_source(dtype: str = "fp32", heads: int = 64, head_dim: int = 512, scale: float | None = None):  # type: ignore[no-untyped-def]
    """The kernel specialised for one TensorRT build (every float tensor `dtype`, fixed H-block, D and scale):
    returns (triton ASTSource, Config). Argument order is TensorRT's AOT convention: input pointers, the int32 extra
    args (S, H, D, Tl, Tg, J), the output pointer."""
    from triton.compiler import ASTSource

    ptr = POINTER_TYPES[dtype]
    cfg = config_for(heads, head_dim, dtype == "fp32")
    signature = {"q_ptr": ptr, "local_ptr": ptr, "global_ptr": ptr, "idx_ptr": "*i64", "sink_ptr": ptr,
                 "S": "i32", "H": "i32", "D": "i32", "TL": "i32", "TG": "i32", "J": "i32", "out_ptr": ptr}
    constexprs = {"SCALE": float(head_dim ** -0.5 if scale is None else scale), "FP32_MATH": dtype == "fp32",
                  "FP32_DOT": cfg.fp32_dot, "BLOCK_H": cfg.block_h, "BLOCK_J": cfg.block_j, "BLOCK_D": cfg.block_d}
    signature.update({k: "constexpr" for k in constexprs})
    attrs = {(i,): ALIGNED for i in (0, 1, 2, 3, 4, 11)}
    if head_dim % 16 == 0:
        attrs[(7,)] = ALIGNED
    return ASTSource(sparse_global_attention_kernel, signature, constexprs=constexprs, attrs=attrs), cfg
