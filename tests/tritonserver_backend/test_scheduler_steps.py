"""How the scheduler spends an iteration: a step's responses stream while its encoder call runs, and the turn still
gets its solo tokens (the onnx engines, in process)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tritonserver_backend.decoder_service import Turn
from tritonserver_backend.encoder_service import Handover
from tritonserver_backend.pipeline import DirectEncoderPort, InProcessPipeline
from tritonserver_backend.registry_init import ensure_registry
from tritonserver_backend.sampling import SamplingParams
from tritonserver_backend.scheduler import TurnRequest, TurnScheduler

PROMPTS = ["How do I center a div?", "grep -rn pattern .", "def area(r):"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    from tests.conftest import EMBEDDED

    root = tmp_path_factory.mktemp("registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, backend="onnx", engine_dir=default_engines)


def _request(pipeline: InProcessPipeline, session: str, text: str) -> TurnRequest:
    ids, prefix, start = pipeline.text.preprocess(text, True, None)
    h19, handover = pipeline.encoder.encode_turn(session, ids, prefix, start)
    adapter = pipeline.router.route([h19], [None])[0]
    return TurnRequest(session, handover, int(adapter), SamplingParams(max_tokens=8))


def test_tokens_stream_while_the_encoder_call_runs(pipeline) -> None:  # type: ignore[no-untyped-def]
    """Each step's encoder call waits until every token of that step has been streamed: were the sends made only after
    the call returns (as before), it would wait in vain and the test fail."""
    solo = {i: pipeline.answer(_request(pipeline, f"solo-{i}", p)).token_ids for i, p in enumerate(PROMPTS)}
    got: dict[str, list[int]] = {f"joint-{i}": [] for i in range(len(PROMPTS))}
    streamed_this_step: list[str] = []
    all_streamed = threading.Event()
    waited: list[bool] = []

    class WaitingPort(DirectEncoderPort):
        def step(self, session_ids: list[str], tokens: np.ndarray, turn_done: bool) -> list[Handover]:
            if not turn_done:
                waited.append(all_streamed.wait(timeout=10))
                all_streamed.clear()
                streamed_this_step.clear()
            return super().step(session_ids, tokens, turn_done)

    def emit(turn: Turn, token: int, reason: str) -> bool:
        if token >= 0:
            got[turn.session_id].append(token)
            streamed_this_step.append(turn.session_id)
            if len(streamed_this_step) == len(scheduler.active):
                all_streamed.set()
        return True

    scheduler = TurnScheduler(pipeline.decoder, WaitingPort(pipeline.encoder), emit, lambda _, exc: pytest.fail(repr(exc)))
    for i, prompt in enumerate(PROMPTS):
        scheduler.submit(_request(pipeline, f"joint-{i}", prompt))
    while not scheduler.idle:
        scheduler.iterate()
    scheduler.close()
    assert [got[f"joint-{i}"] for i in range(len(PROMPTS))] == [solo[i] for i in range(len(PROMPTS))]
    assert len(waited) >= 7 and all(waited)
