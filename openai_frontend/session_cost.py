"""What one server session costs in bytes, so the frontend's prefix cache can be bounded by the same budget as the
server's session stores (`session_budget_bytes`) instead of by a count that means nothing in memory.

The server keeps an `EncoderRow` (window rings + every KV source's global entries) and a `DecoderRow` (layer E's
mirror, the last W hand-over rows, the decoder rings) per session; both have a fixed part and a part that grows with
the positions held. The fixed parts are measured on empty rows; the growth per token follows the layout (a ratio-2
source keeps one entry per two tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

F32_BYTES = 4


@dataclass(frozen=True)
class SessionCost:
    fixed: int
    per_token: float

    def bytes(self, tokens: int) -> int:
        return int(self.fixed + self.per_token * tokens)

    @classmethod
    def of_model(cls, model_dir: Path) -> "SessionCost":
        from ced.model.config import CEDConfig
        from ced.steps.layout import StepLayout
        from ced.steps.rows import DecoderRow, EncoderRow

        layout = StepLayout(CEDConfig.load(Path(model_dir) / "config.json"))
        cfg = layout.cfg
        entry = (cfg.head_dim + cfg.index_head_dim) * F32_BYTES
        encoder = sum(entry / layout.ratio[s] for s in layout.sources)
        decoder = entry / layout.ratio[cfg.first_decoder_layer] if cfg.first_decoder_layer in layout.ratio else entry
        return cls(EncoderRow.empty(layout).nbytes() + DecoderRow.empty(layout).nbytes(), encoder + decoder)
