"""The scheduler's decode lanes: turns split into alternating lanes, joining mid-way and ending at different lengths,
get token for token what each gets alone, with one lane or two (the onnx engines, in process)."""

from __future__ import annotations

import pytest

from tests.tritonserver_backend.in_process import onnx_pipeline, routed_request
from tritonserver_backend.core.decoder_service import Turn
from tritonserver_backend.core.pipeline import DirectEncoderPort, InProcessPipeline
from tritonserver_backend.core.scheduler import TurnScheduler, TurnStart

PROMPTS = ["How do I center a div?", "grep -rn pattern .", "def area(r):", "Tell me a story.", "ls -la /tmp",
           "color: red;"]
LENGTHS = [9, 4, 12, 7, 10, 5]  # max_tokens: turns end at different steps, so lanes empty and rows leave


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    return onnx_pipeline(tmp_path_factory, default_engines)


def _request(pipeline: InProcessPipeline, session: str, index: int) -> TurnStart:
    return routed_request(pipeline, session, PROMPTS[index], LENGTHS[index])


def _run_together(pipeline: InProcessPipeline, tag: str, lanes: int,
                  max_active: int) -> tuple[dict[str, list[int]], list[int]]:
    tokens: dict[str, list[int]] = {}
    failures: list[BaseException] = []

    def emit(turn: Turn, token: int, reason: str) -> bool:
        if token >= 0:
            tokens.setdefault(turn.session_id, []).append(token)
        return True

    scheduler = TurnScheduler(pipeline.decoder, DirectEncoderPort(pipeline.encoder), emit,
                              lambda _, exc: failures.append(exc), max_active=max_active, lanes=lanes)
    lane_sizes = []
    for i in range(3):  # three turns now, three more join while the first ones decode
        scheduler.submit(_request(pipeline, f"{tag}-{i}", i))
    iterations = 0
    while not scheduler.idle:
        if iterations == 3:
            for i in range(3, len(PROMPTS)):
                scheduler.submit(_request(pipeline, f"{tag}-{i}", i))
        scheduler.iterate()
        lane_sizes.append(min(len(lane) for lane in scheduler.lanes))
        iterations += 1
    scheduler.close()
    assert not failures, failures
    return {s.split("-", 1)[1]: t for s, t in tokens.items()}, lane_sizes


def test_lanes_give_every_turn_its_solo_tokens(pipeline) -> None:  # type: ignore[no-untyped-def]
    solo = {str(i): pipeline.answer(_request(pipeline, f"solo-{i}", i)).token_ids for i in range(len(PROMPTS))}
    two, lane_sizes = _run_together(pipeline, "two", lanes=2, max_active=4)
    one, _ = _run_together(pipeline, "one", lanes=1, max_active=4)
    assert two == solo and one == solo
    assert max(lane_sizes) >= 2  # both lanes held turns at once (the alternation was exercised)
    assert [len(t) for _, t in sorted(solo.items())] == LENGTHS


def test_lanes_out_of_range_are_refused(pipeline) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="decode lanes"):
        TurnScheduler(pipeline.decoder, DirectEncoderPort(pipeline.encoder), lambda *_: True, lambda *_: None, lanes=3)
