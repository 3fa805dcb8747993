"""Small numerical building blocks of the CED network: RMSNorm, interleaved (YaRN) RoPE, GEMM-input fake-quant.

They are pure functions of tensors so that the reference network and the engine steps share one definition of each
operation; attention itself is one of the `plugins/` ops.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ced.model.quant_formats import fp8_qdq

#: Values per ue8m0 scale when a GEMM input is quantized to fp8 (the release's `fp8_block_size`: 32 along K).
ACT_QUANT_BLOCK = 32


class _QuantSwitch(Protocol):
    runtime_fake_quant: bool


def gemm_input(x: torch.Tensor, cfg: _QuantSwitch) -> torch.Tensor:
    """What a GEMM against a released fp8/fp4 weight reads: x fake-quantized to fp8 e4m3 when the config runs V4.1's
    runtime fake-quant, x itself (the same tensor object, so arithmetic stays bit-identical) otherwise.

    Why: the release stores those weights in fp8 (fp4 for routed experts) and its `linear()` quantizes the activation
    before each such GEMM, per 32 values along K with a power-of-two (ue8m0) scale; `fp8_qdq(x, 32)` is that
    quantize-dequantize bit for bit. The weights the release keeps in bf16/fp32 (MoE gate, head, compressor,
    indexer weights_proj and wk, the grouped wo_a) read x unquantized, so their callers never come here.
    """
    return fp8_qdq(x, ACT_QUANT_BLOCK) if cfg.runtime_fake_quant else x


class ActQuantLinear(nn.Linear):
    """A bias-free Linear whose GEMM reads `gemm_input(x)`: one of the release's fp8/fp4-weight projections.

    The quantization happens inside `forward`, so the module's *input* (what forward hooks see) stays the
    unquantized x. That is deliberate: LoRA adapters (ced/lora, the decoder step's `LoraInputs.linear`)
    are ours, trained in fp32 against unquantized activations, so the LoRA product reads x while only the base
    GEMM reads the fp8 activation: y = fp8_qdq(x) W^T + (x A) B. The exported steps decide the same way from
    `quantizes_input(module)`. Parameter names and shapes are nn.Linear's, so checkpoints and adapters are unchanged.
    """

    def __init__(self, in_features: int, out_features: int, quantize_input: bool) -> None:
        super().__init__(in_features, out_features, bias=False)
        if quantize_input and in_features % ACT_QUANT_BLOCK:
            raise ValueError(f"an fp8-quantized GEMM input needs in_features divisible by {ACT_QUANT_BLOCK}, "
                             f"got {in_features}")
        self.quantize_input = quantize_input

    def gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_qdq(x, ACT_QUANT_BLOCK) if self.quantize_input else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.gemm_input(x), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quantize_input={self.quantize_input}"


def quantizes_input(module: nn.Module) -> bool:
    """Whether `module`'s GEMM reads an fp8 fake-quantized input: an `ActQuantLinear` built with the switch on, or a
    projection that replaced one and kept its `quantize_input` (the bounded build's `StoredLinear`)."""
    return bool(getattr(module, "quantize_input", False)) and isinstance(module, nn.Module)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (`w * x * rsqrt(mean(x^2) + eps)`), as V4.1 does for every norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def rope_inv_freq(
    rope_dim: int,
    theta: float,
    yarn_original_seq_len: int = 0,
    yarn_factor: float = 1.0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """Per-pair inverse frequencies, with YaRN interpolation when `yarn_original_seq_len > 0`.

    YaRN keeps the high-frequency pairs (which resolve nearby positions) and divides the low-frequency ones by the
    factor, blending linearly between the two correction dims; the compressed layers of V4.1 use it so positions
    far beyond the pre-training length stay distinguishable.
    """
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64, device="cpu") / rope_dim))
    if yarn_original_seq_len <= 0 or yarn_factor == 1.0:
        return inv.float()

    def correction_dim(n_rotations: float) -> float:
        return rope_dim * math.log(yarn_original_seq_len / (n_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1 where the original frequency is kept
    return (inv / yarn_factor * (1 - keep) + inv * keep).float()


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (..., rope_dim/2) for integer positions of any shape."""
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(device=positions.device, dtype=torch.float64)
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
                    inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rope_dim` channels of x as interleaved pairs (2i, 2i+1); the rest pass through.

    x: (..., S, [heads,] D); cos/sin broadcast to (..., S, [1,] rope_dim/2). `inverse` rotates by -angle, which
    V4.1 applies to the attention output so that the value's rope tail ends up relative to the query position.
    """
    head, tail = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim :]
    pairs = tail.float().unflatten(-1, (rope_dim // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    s = -sin if inverse else sin
    rotated = torch.stack((a * cos - b * s, a * s + b * cos), dim=-1).flatten(-2)
    return torch.cat((head, rotated.to(x.dtype)), dim=-1)
