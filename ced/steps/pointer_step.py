"""The MoL2 head's request side as a step: pooled H19 of a batch of requests against the cached option side."""

from __future__ import annotations

import torch
from torch import nn

from ced.routing.pointer_head import OptionCache, PointerHead
from plugins.pointer_score import pointer_score


class PointerStep(nn.Module):
    """query_norm -> query_proj -> cross_norm, then the `mol2` PointerScore op against the folded option cache."""

    def __init__(self, head: PointerHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, h19: torch.Tensor, attn_query: torch.Tensor, attn_bias: torch.Tensor, point_query: torch.Tensor,
                point_read: torch.Tensor, point_bias: torch.Tensor, option_mask: torch.Tensor) -> torch.Tensor:
        h = self.head
        x = h.query_proj(h.query_norm(h19.float()))
        return pointer_score(x, h.cross_norm(x), attn_query, attn_bias, point_query, point_read, point_bias,
                             option_mask, h.cfg.heads)


def option_inputs(options: OptionCache) -> dict[str, torch.Tensor]:
    """The option cache as the pointer graph's inputs (everything but h19 and option_mask)."""
    return {"attn_query": options.attn_query, "attn_bias": options.attn_bias, "point_query": options.point_query,
            "point_read": options.point_read, "point_bias": options.point_bias}
