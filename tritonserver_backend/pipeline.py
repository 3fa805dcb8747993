"""The whole serving path in one process, on the same services the Triton models wrap.

Used as the reference the Triton tests compare with (token for token), and by tools that want the serving
behaviour without a server. The order is the ensemble's: preprocess -> encoder -> router -> decoder (which calls
the encoder per generated token) -> postprocess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .counters import Counters
from .decoder_service import DecoderService
from .encoder_service import EncoderService
from .errors import TurnRejected
from .registry import BASE_NAME, Registry
from .router_service import RouterService
from .sampling import SamplingParams
from .text_service import TextService


@dataclass
class TurnResult:
    token_ids: list[int]
    text: str
    adapter: str
    finish_reason: str
    pieces: list[str] = field(default_factory=list)


class InProcessPipeline:
    def __init__(self, model_dir: str | Path, registry_root: str | Path, max_context: int = 8192) -> None:
        self.counters = Counters()
        self.registry = Registry(registry_root)
        self.text = TextService(model_dir)
        self.encoder = EncoderService(model_dir, max_context=max_context)
        self.router = RouterService(model_dir, Registry(registry_root), self.counters)
        self.decoder = DecoderService(model_dir, Registry(registry_root), self.counters, max_context=max_context)

    def chat(self, session_id: str, text: str, adapter: str | None = None, new_session: bool = False, history: str | None = None, params: SamplingParams | None = None, end_session: bool = False) -> TurnResult:
        params = params or SamplingParams()
        check_explicit(self.registry, adapter)  # fail before anything is encoded
        ids, prefix, start = self.text.preprocess(text, new_session, history)
        h19, handover = self.encoder.encode(session_id, ids, prefix, start)
        routed = self.router.route([h19], [adapter])[0]
        if isinstance(routed, Exception):
            raise routed
        tokens, pieces, finish = [], [], ""
        try:
            for tok, fin in self.decoder.generate(session_id, handover, routed, params, lambda s, t: self.encoder.encode(s, t)[1]):
                if tok >= 0:
                    tokens.append(tok)
                    pieces.append(self.text.piece(tok))
                finish = fin or finish
        except TurnRejected:
            self.encoder.rollback(session_id)
            raise
        if end_session:
            self.decoder.end(session_id)
            self.encoder.end(session_id)
        return TurnResult(tokens, self.text.decode(tokens), self.registry.name_of(int(routed)), finish, pieces)


def check_explicit(registry: Registry, adapter: str | None) -> None:
    """An explicit adapter must exist before the turn is encoded (errors lose nothing)."""
    if adapter and adapter != BASE_NAME:
        registry.refresh()
        registry.by_name(adapter)

