"""The attention both attention ops share: every query reads its own list of keys (K = V latent) plus a sink.

Each query position gets an explicit list of key rows (its sliding window in position order, then its top-k global
entries), gathered from key tables; -1 marks an unused slot. Reducing over a fixed-length list in a fixed order makes
a query's result independent of how the sequence was chunked and of which other rows share the batch, which is what
lets a session rebuilt from its history, or decoded in a batch, reproduce a solo run bit for bit.
"""

from __future__ import annotations

import torch


def gather_keys(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table (B, T, D), idx (B, S, J) int64 -> (B, S, J, D); -1 (and any index) is clamped into range: callers mask."""
    B, S, J = idx.shape
    safe = idx.clamp(0, max(table.shape[1] - 1, 0)).reshape(B, S * J, 1).expand(B, S * J, table.shape[2])
    return table.gather(1, safe).view(B, S, J, table.shape[2])


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, S, H, D), keys (B, S, J, D), valid (B, S, J) bool, sink (H,) -> (B, S, H, D) in q's dtype, fp32 math.

    The sink is a per-head logit that enters only the softmax denominator; a query with no valid key returns zeros
    (the sink takes all the mass), as the released kernel does.
    """
    kf = keys.float()
    scores = torch.einsum("bshd,bsjd->bshj", q.float(), kf) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sink_b = sink.float().view(1, 1, -1, 1)
    peak = torch.maximum(scores.amax(-1, keepdim=True), sink_b).detach()  # any shift is exact; no gradient needed
    weights = torch.exp(scores - peak)
    denom = weights.sum(-1, keepdim=True) + torch.exp(sink_b - peak)
    return torch.einsum("bshj,bsjd->bshd", weights / denom, kf).to(q.dtype)
