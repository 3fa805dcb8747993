"""OpenAI Triton kernels of PointerScore: the MoL2 pointer's request side against the folded option cache.

With L = n * T option tokens per head and HL = heads * L columns:

    scores = xn @ attn_query + attn_bias           (B, HL), -inf on the tokens of non-candidate options
    attn   = softmax per head over its L columns
    logits = x @ point_query + point_bias + attn @ point_read, -inf where the option is not a candidate

Two kernels (what `pointer_score_triton` runs):

1. `pointer_scores_kernel`, grid (cdiv(HL, BLOCK_C), cdiv(B, BLOCK_B)): one (BLOCK_B rows x BLOCK_C columns) tile of
   the masked scores per program, reduced over w in BLOCK_W steps, written to an fp32 scratch (B, HL). The big
   operand, attn_query (w x HL), is read once per block of 16 rows, spread over every SM.
2. `pointer_logits_kernel` with FUSED=False, grid (cdiv(B, BLOCK_B),): per block of rows, for each head an online
   softmax over that head's L scores accumulating attn @ point_read (BLOCK_L x n tiles), divided by the head's
   denominator and summed over heads; then x @ point_query + point_bias, and -inf outside the candidate set.

The TensorRT AOT plugin must be one kernel without scratch, so it compiles `pointer_logits_kernel` with FUSED=True:
the same program computes its score tiles itself (reading attn_query once per block of rows, on cdiv(B, 16)
programs only; fine for the small B of routing, slow for a huge option cache). A row with no candidate gets -inf
everywhere, as the reference (whose softmax is NaN there before the final mask). fp32 throughout (IEEE dots); the
block sizes depend on n only, so a row's logits do not depend on the other rows of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plugins.sparse_global_attention.kernel import on_device


@triton.jit
def score_tile(xn_ptr, aq_ptr, ab_ptr, mask_ptr, offs_b, b_ok, cols, c_ok, W, N, HL, L, T,
               BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """(BLOCK_B, BLOCK_C) masked scores of rows `offs_b` at columns `cols` (global column ids in [0, HL))."""
    acc = tl.zeros([BLOCK_B, BLOCK_C], tl.float32)
    for w0 in range(0, W, BLOCK_W):
        offs_w = (w0 + tl.arange(0, BLOCK_W)).to(tl.int64)  # w x HL may pass 2**31
        w_ok = offs_w < W
        a = tl.load(xn_ptr + offs_b[:, None] * W + offs_w[None, :], mask=b_ok[:, None] & w_ok[None, :], other=0.0)
        k = tl.load(aq_ptr + offs_w[:, None] * HL + cols[None, :], mask=w_ok[:, None] & c_ok[None, :], other=0.0)
        acc += tl.dot(a, k, input_precision="ieee")
    s = acc + tl.load(ab_ptr + cols, mask=c_ok, other=0.0)[None, :]
    option = (cols % L) // T
    ok = b_ok[:, None] & c_ok[None, :]
    candidate = tl.load(mask_ptr + offs_b[:, None] * N + option[None, :], mask=ok, other=0) != 0
    return tl.where(candidate & ok, s, float("-inf"))


@triton.jit
def pointer_scores_kernel(xn_ptr, aq_ptr, ab_ptr, mask_ptr, B, W, N, HL, HEADS, scores_ptr,
                          BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_b = (tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    b_ok = offs_b < B
    c_ok = offs_c < HL
    L = HL // HEADS
    s = score_tile(xn_ptr, aq_ptr, ab_ptr, mask_ptr, offs_b, b_ok, offs_c, c_ok, W, N, HL, L, L // N, BLOCK_B, BLOCK_C,
                   BLOCK_W)
    tl.store(scores_ptr + offs_b[:, None] * HL + offs_c[None, :], s, mask=b_ok[:, None] & c_ok[None, :])


@triton.jit
def pointer_logits_kernel(x_ptr, xn_ptr, aq_ptr, ab_ptr, pq_ptr, pr_ptr, pb_ptr, mask_ptr,  # inputs, in the op's order
                          B, W, N, HL, HEADS,  # int32 scalars (TensorRT AOT: the extra args)
                          out_ptr,  # output
                          scores_ptr,  # the scores kernel's output (FUSED=False); None when FUSED
                          FUSED: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    offs_b = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    b_ok = offs_b < B
    n_ok = offs_n < N
    L = HL // HEADS
    T = L // N
    read = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    for h in range(0, HEADS):
        m = tl.full([BLOCK_B], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_B], tl.float32)
        acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
        for l0 in range(0, L, BLOCK_L):
            offs_l = l0 + tl.arange(0, BLOCK_L)
            l_ok = offs_l < L
            cols = (h * L + offs_l).to(tl.int64)
            if FUSED:
                s = score_tile(xn_ptr, aq_ptr, ab_ptr, mask_ptr, offs_b, b_ok, cols, l_ok, W, N, HL, L, T, BLOCK_B,
                               BLOCK_L, BLOCK_W)
            else:
                s = tl.load(scores_ptr + offs_b[:, None] * HL + cols[None, :], mask=b_ok[:, None] & l_ok[None, :],
                            other=float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: keep exp() finite
            alpha = tl.exp(m - shift)
            p = tl.exp(s - shift[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(pr_ptr + cols[:, None] * N + offs_n[None, :], mask=l_ok[:, None] & n_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        read += acc / denom[:, None]  # 0 / 0 = NaN for a row without candidates: masked below, as the reference
    lin = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        w_ok = offs_w < W
        xa = tl.load(x_ptr + offs_b[:, None] * W + offs_w[None, :], mask=b_ok[:, None] & w_ok[None, :], other=0.0)
        pq = tl.load(pq_ptr + offs_w[:, None] * N + offs_n[None, :], mask=w_ok[:, None] & n_ok[None, :], other=0.0)
        lin += tl.dot(xa, pq, input_precision="ieee")
    logits = lin + tl.load(pb_ptr + offs_n, mask=n_ok, other=0.0)[None, :] + read
    ok = b_ok[:, None] & n_ok[None, :]
    candidate = tl.load(mask_ptr + offs_b[:, None] * N + offs_n[None, :], mask=ok, other=0) != 0
    tl.store(out_ptr + offs_b[:, None] * N + offs_n[None, :], tl.where(candidate, logits, float("-inf")), mask=ok)


@dataclass(frozen=True)
class Config:
    """Block sizes of the pointer kernels: a function of n only (never of B)."""

    block_b: int = 16
    block_c: int = 64
    block_l: int = 64
    block_w: int = 32
    block_n: int = 16
    num_warps: int = 4
    num_stages: int = 2


def config_for(options: int) -> Config:
    return Config(block_n=max(16, triton.next_power_of_2(options)), num_warps=4 if options <= 64 else 8)


def check_inputs(x: torch.Tensor, xn: torch.Tensor, attn_query: torch.Tensor, attn_bias: torch.Tensor,
                 point_query: torch.Tensor, point_read: torch.Tensor, point_bias: torch.Tensor,
                 option_mask: torch.Tensor, heads: int) -> None:
    B, n = option_mask.shape
    w = x.shape[1]
    HL = attn_bias.shape[0]
    shapes = {"x": (x, (B, w)), "xn": (xn, (B, w)), "attn_query": (attn_query, (w, HL)),
              "point_query": (point_query, (w, n)), "point_read": (point_read, (HL, n)),
              "point_bias": (point_bias, (n,))}
    for name, (t, want) in shapes.items():
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be {want}, got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (PointerScore is fp32), got {t.dtype}")
    if attn_bias.dtype != torch.float32 or option_mask.dtype != torch.bool:
        raise ValueError("attn_bias must be float32 and option_mask bool")
    if heads <= 0 or HL % heads or (HL // heads) % max(n, 1):
        raise ValueError(f"attn_bias length {HL} must be heads ({heads}) x n ({n}) x tokens per option")
    devices = {t.device for t in (x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def launch(x: torch.Tensor, xn: torch.Tensor, attn_query: torch.Tensor, attn_bias: torch.Tensor,
           point_query: torch.Tensor, point_read: torch.Tensor, point_bias: torch.Tensor, option_mask: torch.Tensor,
           heads: int, out: torch.Tensor, fused: bool = False, config: Config | None = None) -> torch.Tensor:
    """Write the logits into `out` (contiguous (B, n) fp32). fused=True runs the single-kernel form (the AOT one)."""
    check_inputs(x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask, heads)
    B, n = option_mask.shape
    W, HL = x.shape[1], attn_bias.shape[0]
    if tuple(out.shape) != (B, n) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous float32 ({B}, {n}) tensor on the inputs' device")
    if out.numel() == 0:
        return out
    cfg = config or config_for(n)
    args = [t.contiguous() for t in (x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask)]
    scores = None
    with on_device(x):
        if not fused and HL > 0:
            scores = torch.empty((B, HL), dtype=torch.float32, device=x.device)
            grid = (triton.cdiv(HL, cfg.block_c), triton.cdiv(B, cfg.block_b))
            pointer_scores_kernel[grid](args[1], args[2], args[3], args[7], B, W, n, HL, heads, scores,
                                        BLOCK_B=cfg.block_b, BLOCK_C=cfg.block_c, BLOCK_W=cfg.block_w,
                                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        pointer_logits_kernel[(triton.cdiv(B, cfg.block_b),)](
            *args, B, W, n, HL, heads, out, scores,
            FUSED=scores is None, BLOCK_B=cfg.block_b, BLOCK_L=cfg.block_l, BLOCK_W=cfg.block_w, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out


def pointer_score_triton(x: torch.Tensor, xn: torch.Tensor, attn_query: torch.Tensor, attn_bias: torch.Tensor,
                         point_query: torch.Tensor, point_read: torch.Tensor, point_bias: torch.Tensor,
                         option_mask: torch.Tensor, heads: int) -> torch.Tensor:
    """Same signature and semantics as `pointer_score_reference` (shapes in reference.py)."""
    out = torch.empty((option_mask.shape[0], point_query.shape[1]), dtype=torch.float32, device=x.device)
    return launch(x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask, int(heads), out)


def aot_source(options: int = 64):  # type: ignore[no-untyped-def]
    """The single-kernel form for TensorRT (n fixed at build time): (triton ASTSource, Config). Arguments: the eight
    inputs, the int32 extra args (B, w, n, HL, heads), out."""
    from triton.compiler import ASTSource

    from plugins.sparse_global_attention.kernel import ALIGNED

    cfg = config_for(options)
    names = ("x_ptr", "xn_ptr", "aq_ptr", "ab_ptr", "pq_ptr", "pr_ptr", "pb_ptr")
    signature = {name: "*fp32" for name in names}
    signature.update({"mask_ptr": "*i1", "B": "i32", "W": "i32", "N": "i32", "HL": "i32", "HEADS": "i32",
                      "out_ptr": "*fp32"})
    constexprs = {"scores_ptr": None, "FUSED": True, "BLOCK_B": cfg.block_b, "BLOCK_L": cfg.block_l,
                  "BLOCK_W": cfg.block_w, "BLOCK_N": cfg.block_n}
    signature.update({k: "constexpr" for k in constexprs})
    attrs = {(i,): ALIGNED for i in (0, 1, 2, 3, 4, 5, 6, 7, 13)}
    return ASTSource(pointer_logits_kernel, signature, constexprs=constexprs, attrs=attrs), cfg
