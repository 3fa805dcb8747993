"""The Dynamo codec of the hand-over: its rows as they cross Dynamo's request plane, numpy arrays <-> JSON-safe dicts
(base64, inline). The Triton codec of the same rows is `tritonserver_backend/triton/handover_codec.py`.

A turn's hand-over is O(new tokens) rows and a per-token step is one row per session (a few KiB on the embedded
default), so they travel inline in the request; `nbytes` is what the docs' hand-over cost counts. The ADAPTER_HASH
rides in the same message as the rows it belongs to.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from tritonserver_backend.core.handover import Handover

Rows = Handover  # a hand-over's rows (tritonserver_backend/core/handover.py), or a step's one row per session


def pack(rows: Rows) -> dict[str, Any]:
    """Arrays -> {key: {"dtype", "shape", "b64"}} (C order)."""
    return {k: {"dtype": a.dtype.str, "shape": list(a.shape),
                "b64": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()}
            for k, a in rows.items()}


def unpack(packed: dict[str, Any]) -> Rows:
    out = {}
    for k, v in packed.items():
        buf = base64.b64decode(v["b64"])
        out[k] = np.frombuffer(buf, dtype=np.dtype(v["dtype"])).reshape(v["shape"]).copy()
    return out


def nbytes(rows: Rows) -> int:
    """Raw bytes of the rows (what would cross a wire as binary; base64 adds a third)."""
    return int(sum(a.nbytes for a in rows.values()))
