"""Hand-over rows <-> the HANDOVER_* tensors they travel as between the encoder and decoder models.

A hand-over is a dict of numpy arrays with one row per position (see `encoder_service.Handover`); several
sessions' rows travel stacked, session after session, and `rows_from_arrays` splits them again. Shapes and dtypes
are checked so a malformed tensor is a clear error, never a crash or a wrong answer.
"""

from __future__ import annotations

import numpy as np

from tritonserver_backend import contract as c
from tritonserver_backend.core.handover import Handover
from tritonserver_backend.errors import BadRequest

FIELDS = {
    c.HANDOVER_POSITIONS.name: "positions",
    c.HANDOVER_STREAMS.name: "streams",
    c.HANDOVER_FFN_PRE.name: "ffn_pre",
    c.HANDOVER_TOPK.name: "topk",
    c.HANDOVER_CANDIDATES.name: "candidates",
    c.HANDOVER_GLOBAL_KV.name: "global_kv",
    c.HANDOVER_INDEX_K.name: "index_k",
}
_SPECS = {spec.name: spec for spec in c.HANDOVER}


def to_arrays(parts: list[Handover]) -> dict[str, np.ndarray]:
    """One or more sessions' rows -> the HANDOVER_* tensors (rows stacked in order)."""
    return {name: np.concatenate([p[field] for p in parts]) for name, field in FIELDS.items()}


def rows_from_arrays(arrays: dict[str, np.ndarray], counts: list[int] | None = None) -> list[Handover]:
    """HANDOVER_* tensors -> one hand-over per session (`counts` rows each; all rows as one session when None)."""
    missing = [n for n in FIELDS if n not in arrays]
    if missing:
        raise BadRequest(f"hand-over lacks tensors {missing}")
    positions = arrays[c.HANDOVER_POSITIONS.name]
    S = positions.shape[0] if positions.ndim == 1 else -1
    checked = {}
    for name, field in FIELDS.items():
        a, spec = arrays[name], _SPECS[name]
        if a.ndim != len(spec.dims) or a.dtype != spec.numpy_dtype or a.shape[0] != S:
            raise BadRequest(f"hand-over tensor {name} has shape {a.shape} dtype {a.dtype}; expected rank "
                             f"{len(spec.dims)}, {np.dtype(spec.numpy_dtype)}, {S} rows")
        checked[field] = np.ascontiguousarray(a)
    counts = [S] if counts is None else counts
    if sum(counts) != S:
        raise BadRequest(f"hand-over has {S} rows, expected {sum(counts)}")
    out, start = [], 0
    for n in counts:
        out.append({f: a[start:start + n] for f, a in checked.items()})
        start += n
    return out
