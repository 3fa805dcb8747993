"""The definition of SparseGlobalAttention (what the network calls on CPU, and what every back end is checked against).

    q          (B, S, H, D)  queries after RoPE
    local_kv   (B, Tl, D)    local key table: the layer's window ring, this chunk's latents (and, in the encoder,
                             this chunk's new global entries, not yet in the global table)
    global_kv  (B, Tg, D)    the KV source's compressed entries (K = V)
    idx        (B, S, J)     int64 per query: j < Tl reads local_kv[j], Tl <= j reads global_kv[j - Tl]; -1 = none
    sink       (H,)          per-head sink logit (denominator only)
    scale      float         softmax scale (D ** -0.5)
    window     int           the first `window` entries of every list are rows of local_kv (or -1); 0: no such
                             promise. It changes no result: back ends may read those entries from local_kv alone
                             (the ONNX function does), and the reference refuses lists that break it.
    -> out     (B, S, H, D)

The first W entries of a query's list are its sliding window in position order, the rest its top-k global entries;
the op itself does not care, it attends to exactly the listed rows in list order.
"""

from __future__ import annotations

import torch

from plugins.attention_math import attend, gather_keys


def check_window(idx: torch.Tensor, local_rows: int, window: int) -> None:
    """The `window` contract: leading entries index local_kv or are -1 (else a back end would read the wrong row)."""
    if not 0 <= window <= idx.shape[-1]:
        raise ValueError(f"window must lie in [0, {idx.shape[-1]}] (the list length), got {window}")
    if window and bool((idx[..., :window] >= local_rows).any()):
        raise ValueError(f"the first {window} entries of every index list must be rows of local_kv (< {local_rows}) "
                         f"or -1")


def sparse_global_attention_reference(q: torch.Tensor, local_kv: torch.Tensor, global_kv: torch.Tensor,
                                      idx: torch.Tensor, sink: torch.Tensor, scale: float,
                                      window: int = 0) -> torch.Tensor:
    check_window(idx, local_kv.shape[1], window)
    table = torch.cat((local_kv, global_kv.to(local_kv.dtype)), 1)
    return attend(q, gather_keys(table, idx), idx >= 0, sink, scale)
