"""HandOver <-> named numpy arrays: how the hand-over travels between the encoder and decoder models."""

from __future__ import annotations

import numpy as np
import torch

from build_engines.model.state import HandOver

from . import contract as c
from .errors import BadRequest

_FIELDS = {
    c.HANDOVER_POSITIONS.name: "positions",
    c.HANDOVER_STREAMS.name: "streams",
    c.HANDOVER_FFN_PRE.name: "ffn_pre",
    c.HANDOVER_TOPK.name: "topk",
    c.HANDOVER_CANDIDATES.name: "candidates",
    c.HANDOVER_GLOBAL_KV.name: "global_kv",
    c.HANDOVER_INDEX_K.name: "index_k",
}
_RANKS = {spec.name: len(spec.dims) for spec in c.HANDOVER}


def to_arrays(h: HandOver) -> dict[str, np.ndarray]:
    """Batch-1 hand-over -> arrays without the batch dim (the contract's shapes)."""
    out = {}
    for name, field in _FIELDS.items():
        t = getattr(h, field)
        t = t if field == "positions" else t[0]
        out[name] = t.detach().cpu().numpy()
    return out


def from_arrays(arrays: dict[str, np.ndarray]) -> HandOver:
    """Arrays -> batch-1 HandOver; shapes and dtypes are checked so a malformed tensor is a clear error."""
    missing = [n for n in _FIELDS if n not in arrays]
    if missing:
        raise BadRequest(f"hand-over lacks tensors {missing}")
    S = arrays[c.HANDOVER_POSITIONS.name].shape[0] if arrays[c.HANDOVER_POSITIONS.name].ndim == 1 else -1
    values = {}
    for name, field in _FIELDS.items():
        a = arrays[name]
        spec_dtype = next(s for s in c.HANDOVER if s.name == name).numpy_dtype
        if a.ndim != _RANKS[name] or a.dtype != spec_dtype or (a.shape[0] != S):
            raise BadRequest(f"hand-over tensor {name} has shape {a.shape} dtype {a.dtype}; expected rank {_RANKS[name]}, {np.dtype(spec_dtype)}, {S} rows")
        t = torch.from_numpy(np.ascontiguousarray(a))
        values[field] = t if field == "positions" else t.unsqueeze(0)
    return HandOver(encoder_out=torch.zeros(1, S, 0, 0), **values)  # H19 travels separately, to the router
