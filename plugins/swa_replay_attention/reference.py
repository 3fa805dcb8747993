"""The definition of SwaReplayAttention: sliding-window attention over one key table, for SWA-only layers.

    q     (B, S, H, D)  queries after RoPE
    kv    (B, T, D)     key table: the layer's window ring followed by this chunk's latents (K = V)
    idx   (B, S, W)     int64 per query: its window rows in position order (oldest first), -1 = none
    sink  (H,)          per-head sink logit (denominator only)
    scale float
    -> out (B, S, H, D)

The same op serves prefill (S = a turn), decode (S = 1) and a bounded replay (S = 128 rows under another adapter).
"""

from __future__ import annotations

import torch

from plugins.attention_math import attend, gather_keys


def swa_replay_attention_reference(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                                   scale: float) -> torch.Tensor:
    return attend(q, gather_keys(kv, idx), idx >= 0, sink, scale)
