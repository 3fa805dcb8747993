"""V4.1 mixture-of-experts FFN: sqrt-softplus gate, bias for selection only, clamped SwiGLU experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ced.model.config import CEDConfig
from ced.model.primitives import ActQuantLinear


class Expert(nn.Module):
    """SwiGLU expert with V4.1's clamps: w1 branch clamped above, w3 branch clamped both sides, fp32 math.

    All three weights are fp4 (routed) or fp8 (shared) in the release, so with `quantize_input` every GEMM reads an
    fp8-quantized input; w2's is the SwiGLU product after the routing weight, quantized as the release does.
    """

    def __init__(self, dim: int, inter: int, limit: float, quantize_input: bool = False) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = ActQuantLinear(dim, inter, quantize_input)
        self.w2 = ActQuantLinear(inter, dim, quantize_input)
        self.w3 = ActQuantLinear(dim, inter, quantize_input)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.w1(x).float().clamp(max=self.limit)
        up = self.w3(x).float().clamp(-self.limit, self.limit)
        h = F.silu(gate) * up
        if weight is not None:  # the routing weight multiplies before w2, as in the release
            h = h * weight.unsqueeze(-1)
        return self.w2(h.to(x.dtype))


class Gate(nn.Module):
    """Scores sqrt(softplus(x W^T)); `bias` shifts only which experts are chosen, never their weights.

    The release keeps the gate weight in bf16 and scores in fp32: its input is never activation-quantized.
    """

    def __init__(self, cfg: CEDConfig) -> None:
        super().__init__()
        self.topk, self.route_scale = cfg.n_activated_experts, cfg.route_scale
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)
        # image-span tokens (unused: no vision)
        self.bias_vl = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)
        nn.init.normal_(self.weight, std=cfg.dim ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, dim) -> dense (N, E) routing weights, zero outside each token's top-k."""
        scores = torch.sqrt(F.softplus(F.linear(x.float(), self.weight.float())))
        idx = torch.topk(scores + self.bias.float(), self.topk, dim=-1).indices
        picked = scores.gather(-1, idx)
        picked = picked / (picked.sum(-1, keepdim=True) + 1e-20) * self.route_scale
        return torch.zeros_like(scores).scatter(-1, idx, picked)


class MoE(nn.Module):
    """Routed experts (top-k of n) plus always-on shared experts; every V4.1 layer's FFN is one of these."""

    def __init__(self, cfg: CEDConfig) -> None:
        super().__init__()
        self.gate = Gate(cfg)
        quant = cfg.runtime_fake_quant
        routed = (Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit, quant) for _ in range(cfg.n_routed_experts))
        self.experts = nn.ModuleList(routed)
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim * cfg.n_shared_experts, cfg.swiglu_limit, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights = self.gate(flat)  # (N, E)
        out = self.shared_experts(flat).float()
        chosen = (weights > 0).any(0)
        for e, expert in enumerate(self.experts):
            if bool(chosen[e]):  # skipping unchosen experts only saves time: their weight is exactly zero
                out = out + expert(flat, weights[:, e]).float()
        return out.to(x.dtype).reshape(shape)
