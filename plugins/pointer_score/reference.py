"""The definition of PointerScore: the request side of the MoL2 head against its folded option cache.

    x            (B, w)      the projected query (query_proj(query_norm(H19 pooled)))
    xn           (B, w)      cross_norm(x)
    attn_query   (w, H*L)    per-head query projection folded with the options' keys, scaled (L = n options x T tokens)
    attn_bias    (H*L,)      its bias, -inf on option padding
    point_query  (w, n)      the pointer's query side folded with the option keys
    point_read   (H*L, n)    each head's values carried through out_proj and the pointer
    point_bias   (n,)
    option_mask  (B, n) bool the options each row may pick (its candidate set)
    heads        int
    -> logits    (B, n), -inf where the option is not a candidate

The cross-attention reads only the row's candidate options; see ced.routing.pointer_head.OptionCache.
"""

from __future__ import annotations

import torch


def pointer_score_reference(x: torch.Tensor, xn: torch.Tensor, attn_query: torch.Tensor, attn_bias: torch.Tensor,
                            point_query: torch.Tensor, point_read: torch.Tensor, point_bias: torch.Tensor,
                            option_mask: torch.Tensor, heads: int) -> torch.Tensor:
    B, n = option_mask.shape
    length = attn_bias.shape[0] // heads  # n options x T tokens
    scores = torch.addmm(attn_bias, xn, attn_query)  # (B, H*L)
    hidden = (~option_mask)[:, None, :, None].expand(B, heads, n, length // n).reshape(B, heads * length)
    scores = scores.masked_fill(hidden, float("-inf"))
    attn = torch.softmax(scores.view(B, heads, length), dim=-1).view(B, heads * length)
    logits = torch.addmm(point_bias, x, point_query) + attn @ point_read
    return logits.masked_fill(~option_mask, float("-inf"))
