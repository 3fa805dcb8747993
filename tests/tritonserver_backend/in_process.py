"""What the in-process scheduler tests share: the embedded default on the onnx engines with its own registry, and a
user turn encoded and routed the way the server's ensemble does it before the decoder sees it."""

from __future__ import annotations

from typing import Any

from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.core.scheduler import TurnStart
from tritonserver_backend.sampling.sampler import SamplingParams


def onnx_pipeline(tmp_path_factory: Any, engine_dir: Any) -> InProcessPipeline:
    from tests.conftest import EMBEDDED

    root = tmp_path_factory.mktemp("registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, backend="onnx", engine_dir=engine_dir)


def routed_request(pipeline: InProcessPipeline, session: str, text: str, max_tokens: int) -> TurnStart:
    """The turn's encoding (the session's next user turn) and the router's adapter, as the decoder receives them."""
    ids, prefix, start = pipeline.text.preprocess(text, True, None)
    encoded = pipeline.encoder.encode_turn(session, ids, prefix, start)
    h19, handover = encoded.h19, encoded.handover
    adapter = pipeline.router.route([h19], [None])[0]
    return TurnStart(session, handover, int(adapter), SamplingParams(max_tokens=max_tokens), turn_id=encoded.turn_id)
