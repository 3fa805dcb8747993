"""The hand-over from the encoder to the decoder: one definition that both services, the Triton codec
(`triton/handover_codec.py`) and the Dynamo wire format share.

A hand-over is one session's rows (S, ...) keyed as `ced.steps.rows.HANDOVER_KEYS` plus "positions": layer 20's
attention output, its FFN mix, top-k, candidate pool and new global-KV / index-key entries. The decoder applies the
turn's adapter to it; nothing in it depends on an adapter.
"""

from __future__ import annotations

import numpy as np

from ced.steps.rows import HANDOVER_KEYS

Handover = dict[str, np.ndarray]
# decode lanes the scheduler may alternate (scheduler.py); one stacked arena each, encoder and decoder
MAX_DECODE_LANES = 2

__all__ = ["HANDOVER_KEYS", "MAX_DECODE_LANES", "Handover"]
