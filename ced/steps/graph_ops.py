"""The network's numerics written for a batched, exported step: per-row positions, no Python control flow on data.

Each function computes what its counterpart in `ced.model` computes (the reference), in a form that
exports to few ONNX nodes and keeps every row's result independent of the other rows in the batch:

- RoPE as `x * cos + x[pairs swapped] * sin` with per-position tables (bit-identical to `apply_rope_tail`);
- the mHC Sinkhorn on flattened 4x4 matrices, each normalisation one matrix product with a 0/1 pattern plus a
  division (the sum form costs three nodes per half step; 20 iterations x 16 sub-layers made it half the graph);
- the MoE with every expert computed densely from concatenated weights (two matrix products), since a batch has
  rows choosing different experts and unchosen weights are exactly zero;
- top-k with ONNX TopK's tie rule (lower index first), -1 where fewer than k entries are finite;
- V4.1's runtime fake-quant (fp8 e4m3 / fp4 e2m1 quantize-dequantize) in plain float ops, bit for bit the
  `ced.model.quant_formats` functions, because a float8 Cast is not valid ONNX at our opset 18.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ced.model.attention import select_top as reference_select_top
from ced.model.config import CEDConfig
from ced.model.moe import MoE
from ced.model.primitives import ACT_QUANT_BLOCK, quantizes_input

# ----------------------------------------------------------------------------------------------- positions, RoPE


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, width: int,
                rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(…,) int64 positions -> cos, sin tables (…, width) for `rope_apply`; fp64 angles as in `rope_angles`.

    The first width - rope_dim channels pass through (cos 1, sin 0); on the rope tail, even channels carry -sin
    (they receive their odd partner) and odd channels +sin.
    """
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    sign = torch.tensor([-1.0, 1.0], dtype=torch.float32).repeat(rope_dim // 2)
    lead = positions.shape + (width - rope_dim,)
    cos_full = torch.cat((torch.ones(lead), cos.repeat_interleave(2, -1)), -1)
    sin_full = torch.cat((torch.zeros(lead), sin.repeat_interleave(2, -1) * sign), -1)
    return cos_full, sin_full


def pair_swap(width: int, rope_dim: int) -> torch.Tensor:
    """Channel permutation that swaps each (even, odd) pair of the rope tail and keeps the rest in place."""
    perm = list(range(width - rope_dim))
    for i in range(width - rope_dim, width, 2):
        perm += [i + 1, i]
    return torch.tensor(perm)


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, swap: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the rope tail of x (…, width); cos/sin broadcast against x. Same products and sums as apply_rope_tail."""
    partner = x.index_select(-1, swap)
    return x * cos + partner * (-sin if inverse else sin)


def window_ring_positions(start: torch.Tensor, ring_start: torch.Tensor, window: int) -> torch.Tensor:
    """(B, W) position held by each ring slot: the last position before `start` with that slot, -1 before ring_start.

    A ring written from `ring_start` on (0 for the encoder; the replay's first row for the decoder) holds exactly the
    positions [max(ring_start, start - W), start), so the positions need not travel with the ring.
    """
    slot = torch.arange(window)
    held = start.unsqueeze(1) - 1 - (start.unsqueeze(1) - 1 - slot).remainder(window)
    return torch.where(held >= ring_start.unsqueeze(1), held, torch.full_like(held, -1))


def chunk_positions(start: torch.Tensor, length: int | torch.SymInt, like: torch.Tensor) -> torch.Tensor:
    """(B, S) positions start .. start + S - 1 per row (`like` supplies the device)."""
    return start.unsqueeze(1) + torch.arange(length, device=like.device).unsqueeze(0)


# ----------------------------------------------------------------------------------------------- norms, selection


def plus_eps(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x + eps that survives export. onnxscript's optimizer removes an `Add` of a scalar constant it takes for zero
    (`math.isclose` with an absolute tolerance of 1e-8), so the release's norm_eps = 1e-20 vanished from every norm of
    the exported graphs and an all-zero row (a replay's padding) became 0 / 0 = NaN (found building the
    release-shaped checkpoint). As a one-element tensor the constant is not a scalar, that rule does not match, and
    the sum is bit for bit the scalar one."""
    return x + torch.full((1,), eps, dtype=x.dtype, device=x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm written as x / sqrt(mean(x^2) + eps) * w: onnxruntime fuses exactly this pattern into one node."""
    xf = x.float()
    y = xf / torch.sqrt(plus_eps(xf.pow(2).mean(-1, keepdim=True), eps))
    return y if weight is None else weight.float() * y


def select_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best scores per row (ties: lower index first), -1 where the score is -inf.

    Eager: the reference's stable sort. Exported: ONNX TopK, whose spec breaks ties by the lower index too (ReLU index
    scores tie at exactly 0 often, so the rule matters). The caller guarantees scores.shape[-1] >= k (the runtime
    pads the global store to at least k entries).
    """
    if not torch.onnx.is_in_onnx_export():
        return reference_select_top(scores, k)
    values, idx = torch.topk(scores, k, dim=-1, largest=True, sorted=True)
    return torch.where(values > float("-inf"), idx, torch.full_like(idx, -1))


# ----------------------------------------------------------------------------------------------- runtime fake-quant
#
# Why plain float ops: `x.to(torch.float8_e4m3fn)` exports as a float8 Cast, which ONNX allows only from opset 19 (our
# graphs are opset 18; onnxruntime refuses the node there) and which TensorRT's parser would have to support too.
# The formats are exact, so they can be written without it: every ue8m0 scale is a power of two (dividing and
# multiplying by it is exact in fp32), and rounding onto the e4m3 or e2m1 grid is `Round(a / step) * step` with the
# grid step of a's binade (ONNX Round is round-half-to-even, as the casts are). A power of two 2^floor(log2 a) or
# 2^ceil(log2 y) is read from a table at a log2 estimate and then corrected by exact comparisons (halve or double
# once), so a log off by an ulp, or a fast GPU log, cannot pick the wrong binade; no step relies on how two float ops
# round together (a fused multiply-add would break error-free tricks such as Veltkamp splitting, not these). Each
# function is tested bit for bit (sign of zero included) against quant_formats, in torch and in onnxruntime. NaN
# inputs are not supported, as there. (A sign chosen with Where would be wrong: onnxruntime's CPU Where drops the sign
# of a selected -0.0; rounding the signed value keeps it.)

_POW2 = torch.exp2(torch.arange(-127, 128, dtype=torch.float64)).float()  # 2^k for k in [-127, 127], exact in fp32
_E4M3_MAX, _E2M1_MAX = 448.0, 6.0
_E4M3_MIN_NORMAL = 2.0**-6  # below it e4m3 is subnormal, with the step of the [2^-6, 2^-5) binade: 2^-9
_FP8_AMAX_FLOOR, _FP4_UE8M0_AMAX_FLOOR, _FP4_E4M3_AMAX_FLOOR = 1e-4, 6.0 * 2.0**-126, 6.0 * 2.0**-9


def _pow2_near(e: torch.Tensor) -> torch.Tensor:
    """2^e for an integer-valued float estimate e, clamped to [-127, 127]: one table lookup, exact."""
    return _POW2[(e.clamp(-127, 127) + 127).long()]


def _pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 y), exactly, for fp32 y in [2^-126, 2^126]: the smallest power of two >= y.

    The log2 estimate is within one binade; one comparison each way corrects it (halving 2^-126 gives the fp32
    subnormal 2^-127, still exact)."""
    p = _pow2_near(torch.ceil(torch.log2(y)))
    p = torch.where(p < y, p * 2.0, p)
    return torch.where(p * 0.5 >= y, p * 0.5, p)


def _pow2_floor(a: torch.Tensor) -> torch.Tensor:
    """2^floor(log2 a), exactly, for fp32 a in [2^-126, 2^126]: the largest power of two <= a."""
    p = _pow2_near(torch.floor(torch.log2(a)))
    p = torch.where(p > a, p * 0.5, p)
    return torch.where(p * 2.0 <= a, p * 2.0, p)


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 v with |v| <= 448 -> the nearest float8_e4m3fn value (ties to even), as fp32: `v.to(float8).float()`.

    e4m3 keeps 3 mantissa bits: in the binade [2^e, 2^(e+1)) its step is 2^(e-3); below 2^-6 (subnormals) the step
    stays 2^-9, the step of the lowest normal binade, so the binade is taken of max(|v|, 2^-6). Rounding v itself
    (not |v|) keeps the sign of a zero result (-tiny -> -0.0), as the cast does: Round is symmetric and sign-keeping."""
    step = _pow2_floor(v.abs().clamp(min=_E4M3_MIN_NORMAL)) * 0.125
    return torch.round(v / step) * step


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 v -> the nearest e2m1 value (ties to the even code), saturating at +-6: quant_formats' E2M1 rounding.

    The e2m1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 has step 0.5 below 2, 1 in [2, 4) and 2 from 4; round-half-to-even
    of v / step is ties-to-even-code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), and a zero keeps v's sign."""
    v = v.clamp(-_E2M1_MAX, _E2M1_MAX)
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return torch.round(v / step) * step


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"fake-quant needs a last dimension divisible by {block}, got shape {tuple(x.shape)}")
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """`quant_formats.fp8_qdq` in exportable ops: e4m3 values, one 2^ceil(log2(max(amax, 1e-4) / 448)) per block."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=_FP8_AMAX_FLOOR)
    scale = _pow2_ceil(amax / _E4M3_MAX)
    return (round_e4m3((xb / scale).clamp(-_E4M3_MAX, _E4M3_MAX)) * scale).flatten(-2)


def fp4_qdq_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """`quant_formats.fp4_qdq_ue8m0` in exportable ops: e2m1 values, one 2^ceil(log2(max(amax, 6*2^-126) / 6)) per
    block."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=_FP4_UE8M0_AMAX_FLOOR)
    scale = _pow2_ceil(amax / _E2M1_MAX)
    return (round_e2m1(xb / scale) * scale).flatten(-2)


def fp4_qdq_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """`quant_formats.fp4_qdq_e4m3` in exportable ops: e2m1 values, one e4m3-rounded min(max(amax, 6*2^-9) / 6, 448)
    per block (not a power of two: the division x / scale is the same fp32 division as there)."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=_FP4_E4M3_AMAX_FLOOR)
    scale = round_e4m3((amax / _E2M1_MAX).clamp(max=_E4M3_MAX))
    return (round_e2m1(xb / scale) * scale).flatten(-2)


# ----------------------------------------------------------------------------------------------- hyper-connections


class SinkhornPatterns:
    """0/1 matrices that turn row and column sums of flattened hc x hc matrices into one matrix product each, and
    the eps row the products add (`addmm` exports as one Gemm: sum and + eps in one node, the division the second)."""

    def __init__(self, hc: int, eps: float) -> None:
        i = torch.arange(hc * hc)
        self.rows = (i.unsqueeze(1) // hc == i.unsqueeze(0) // hc).float()  # (hc², hc²): sum over the row, broadcast
        self.cols = (i.unsqueeze(1) % hc == i.unsqueeze(0) % hc).float()
        self.eps = torch.full((hc * hc,), eps)


class HcMix:
    """One sub-layer's mixing parameters (`hc_{attn,ffn}_{fn,base,scale}`) folded for the step: the three scales
    multiply fn's rows, so the coefficients are one normalisation, one matrix product and one bias."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int) -> None:
        scale_vec = torch.cat((scale[0].expand(hc), scale[1].expand(hc), scale[2].expand(hc * hc))).float()
        self.fn_t = (fn.float() * scale_vec.unsqueeze(1)).t().contiguous()  # (hc*dim, (2+hc)*hc)
        self.base = base.float()


def hc_coefficients(X: torch.Tensor, mix: HcMix, cfg: CEDConfig,
                    patterns: SinkhornPatterns) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `hyper_connections.hc_coefficients`: X (B, S, hc, dim) -> pre, post (B, S, hc), C (B, S, hc, hc)."""
    hc, eps = cfg.hc_mult, cfg.hc_eps
    B, S = X.shape[0], X.shape[1]
    z = rms_norm(X.flatten(-2), None, cfg.norm_eps) @ mix.fn_t + mix.base
    pre_z, post_z, c_z = torch.split(z, [hc, hc, hc * hc], dim=-1)
    pre = torch.sigmoid(pre_z) + eps
    post = 2 * torch.sigmoid(post_z)
    flat = (torch.softmax(c_z.reshape(-1, hc, hc), dim=-1) + eps).reshape(-1, hc * hc)
    flat = flat / torch.addmm(patterns.eps, flat, patterns.cols)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        flat = flat / torch.addmm(patterns.eps, flat, patterns.rows)
        flat = flat / torch.addmm(patterns.eps, flat, patterns.cols)
    return pre, post, flat.view(B, S, hc, hc)


def collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """(B, S, hc, dim), (B, S, hc) -> (B, S, dim): the pre-weighted sum of the streams."""
    return (pre.unsqueeze(-2) @ X.float()).squeeze(-2)


def expand(y: torch.Tensor, post: torch.Tensor, C: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """New streams X'[k] = post[k] * y + sum_j C[j, k] X[j]."""
    return post.unsqueeze(-1) * y.float().unsqueeze(-2) + C.transpose(-1, -2) @ X.float()


# ----------------------------------------------------------------------------------------------- MoE


def expert_members(moe: nn.Module) -> tuple[list[nn.Module], list[int] | None]:
    """The experts a MoE computes here, routed then shared, and their columns among the gate's weights (routed ids,
    then n_routed for the shared expert); None when it computes all of them. A tensor-parallel rank's MoE
    (`parallel.modules.ParallelMoE`) holds slices of all of them, an expert-parallel rank only its own experts
    (and rank 0 the shared one)."""
    owned = getattr(moe, "owned", None)
    if owned is None:
        return list(moe.experts) + [moe.shared_experts], None  # type: ignore[arg-type, operator]
    shared = [] if moe.shared_experts is None else [moe.shared_experts]
    columns = list(owned) + ([len(moe.gate.weight)] if shared else [])
    members = [moe.experts[str(e)] for e in owned] + shared  # type: ignore[index]
    return members, None if columns == list(range(len(moe.gate.weight) + 1)) else columns


class DenseExperts:
    """Every expert of one MoE (routed, then shared) as two concatenated weight matrices.

    w13: (dim, G * 2 * I) with columns [expert g][w1 | w3][inter]; w2: (G * I, dim). G = routed + 1 shared.
    Under the runtime fake-quant both products read fp8-quantized inputs (`gemm_input`), as every expert's w1/w3/w2
    does in the reference; per 32 along K that is the same as quantizing each expert's slice, since I % 32 == 0.
    """

    def __init__(self, moe: MoE) -> None:
        experts, self.columns = expert_members(moe)
        self.count = len(experts)
        self.inter = experts[0].w1.out_features
        if any(e.w1.out_features != self.inter for e in experts):
            raise ValueError("dense experts need one intermediate width for routed and shared experts")
        self.limit = experts[0].limit
        quant = {quantizes_input(w) for e in experts for w in (e.w1, e.w2, e.w3)}
        if len(quant) != 1:
            raise ValueError("dense experts need every expert projection quantized alike")
        self.quantize_input = quant.pop()
        self.w13 = torch.cat([torch.cat((e.w1.weight, e.w3.weight), 0) for e in experts], 0).t().contiguous().float()
        self.w2 = torch.cat([e.w2.weight.t() for e in experts], 0).contiguous().float()
        self.gate_weight = moe.gate.weight  # cast where read: a stored bf16 gate stays bf16 until the step runs
        self.gate_bias = moe.gate.bias
        self.topk, self.route_scale = moe.gate.topk, moe.gate.route_scale

    def gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        """What w13 and w2 read: x, or its fp8 quantize-dequantize under the runtime fake-quant (LoRA reads x)."""
        return fp8_qdq(x, ACT_QUANT_BLOCK) if self.quantize_input else x

    def routing_weights(self, x: torch.Tensor) -> torch.Tensor:
        """x (…, dim) -> (…, G) weights: the gate's top-k (sqrt-softplus, bias for selection only), then 1 for
        shared."""
        scores = torch.sqrt(F.softplus(x.float() @ self.gate_weight.float().t()))
        idx = torch.topk(scores + self.gate_bias.float(), self.topk, dim=-1).indices
        picked = scores.gather(-1, idx)
        picked = picked / plus_eps(picked.sum(-1, keepdim=True), 1e-20) * self.route_scale
        routed = torch.zeros_like(scores).scatter(-1, idx, picked)
        weights = torch.cat((routed, torch.ones_like(scores[..., :1])), -1)
        return weights if self.columns is None else weights[..., self.columns]

    def up(self, xq: torch.Tensor) -> torch.Tensor:
        """(…, dim) GEMM input -> (…, G*2*I) every expert's w1 | w3 products."""
        return xq @ self.w13

    def down(self, aq: torch.Tensor) -> torch.Tensor:
        """(…, G*I) GEMM input -> (…, dim): every expert's w2 product, summed."""
        return aq @ self.w2

    def activations(self, h13: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """(…, G*2*I) up-projections, (…, G) weights -> (…, G*I) clamped SwiGLU times the routing weight."""
        h = h13.unflatten(-1, (self.count, 2, self.inter))
        gate = h[..., 0, :].clamp(max=self.limit)
        up = h[..., 1, :].clamp(-self.limit, self.limit)
        return (F.silu(gate) * up * weights.unsqueeze(-1)).flatten(-2)
