"""Manifold-constrained hyper-connections (mHC): hc residual streams mixed by a Sinkhorn-normalised matrix."""

from __future__ import annotations

import torch
from torch import nn

from ced.model.config import CEDConfig


def hc_coefficients(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    cfg: CEDConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sub-layer's mixing coefficients from the streams it receives (parameters `hc_{attn,ffn}_{fn,base,scale}`).

    X: (B, S, hc, dim) -> pre (B, S, hc), post (B, S, hc), C (B, S, hc, hc); all fp32. C is pushed towards a
    doubly stochastic matrix by Sinkhorn iterations, which keeps the residual mixing norm-preserving however deep
    the stack.
    """
    hc, eps = cfg.hc_mult, cfg.hc_eps
    v = X.float().flatten(-2)  # (B, S, hc*dim)
    m = (v @ fn.float().t()) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    C = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    C = torch.softmax(C, dim=-1) + eps
    C = C / (C.sum(-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        C = C / (C.sum(-1, keepdim=True) + eps)
        C = C / (C.sum(-2, keepdim=True) + eps)
    return pre, post, C


def collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the streams: (B, S, hc, dim), (B, S, hc) -> (B, S, dim)."""
    return (pre.unsqueeze(-1) * X.float()).sum(-2).to(X.dtype)


def expand(y: torch.Tensor, post: torch.Tensor, C: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """New streams X[k] = post[k] * y + sum_j C[j, k] * residual[j]."""
    mixed = torch.einsum("bsjk,bsjd->bskd", C, residual.float())
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(residual.dtype)


def init_hc_parameters(cfg: CEDConfig) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """fn small, base chosen so pre/post start near 1 and C near identity-ish: a stable start for training."""
    fn = nn.Parameter(torch.randn(cfg.n_hc_mix, cfg.hc_mult * cfg.dim) * (cfg.hc_mult * cfg.dim) ** -0.5 * 0.1)
    base = torch.zeros(cfg.n_hc_mix)
    base[2 * cfg.hc_mult :] = torch.eye(cfg.hc_mult).flatten() * 4.0
    scale = nn.Parameter(torch.ones(3) * 0.1)
    return fn, nn.Parameter(base), scale
