"""How the scheduler spends an iteration: a step's responses stream while its encoder call runs, and the turn still
gets its solo tokens (the onnx engines, in process)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.tritonserver_backend.in_process import onnx_pipeline, routed_request
from tritonserver_backend.core.decoder_service import Turn
from tritonserver_backend.core.handover import Handover
from tritonserver_backend.core.pipeline import DirectEncoderPort, InProcessPipeline
from tritonserver_backend.core.scheduler import TurnScheduler, TurnStart

PROMPTS = ["How do I center a div?", "grep -rn pattern .", "def area(r):"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    return onnx_pipeline(tmp_path_factory, default_engines)


def _request(pipeline: InProcessPipeline, session: str, text: str) -> TurnStart:
    return routed_request(pipeline, session, text, max_tokens=8)


def test_tokens_stream_while_the_encoder_call_runs(pipeline) -> None:  # type: ignore[no-untyped-def]
    """Each step's encoder call waits until every token of that step has been streamed: were the sends made only after
    the call returns (as before), it would wait in vain and the test fail."""
    solo = {i: pipeline.answer(_request(pipeline, f"solo-{i}", p)).token_ids for i, p in enumerate(PROMPTS)}
    got: dict[str, list[int]] = {f"joint-{i}": [] for i in range(len(PROMPTS))}
    streamed_this_step: list[str] = []
    all_streamed = threading.Event()
    waited: list[bool] = []

    class WaitingPort(DirectEncoderPort):
        def step(self, session_ids: list[str], tokens: np.ndarray, turn_done: bool, *args, **kwargs) -> list[Handover]:  # type: ignore[no-untyped-def]
            # a token step runs on the encoder-call thread while its tokens stream; a turn's trailing tokens and its
            # commit are sent from the scheduler's own thread once the turn has ended
            if threading.current_thread().name.startswith("mol2-encoder-call"):
                waited.append(all_streamed.wait(timeout=10))
                all_streamed.clear()
                streamed_this_step.clear()
            return super().step(session_ids, tokens, turn_done, *args, **kwargs)

    def emit(turn: Turn, token: int, reason: str) -> bool:
        if token >= 0:
            got[turn.session_id].append(token)
            streamed_this_step.append(turn.session_id)
            if len(streamed_this_step) == len(scheduler.active):
                all_streamed.set()
        return True

    scheduler = TurnScheduler(pipeline.decoder, WaitingPort(pipeline.encoder), emit,
                              lambda _, exc: pytest.fail(repr(exc)))
    for i, prompt in enumerate(PROMPTS):
        scheduler.submit(_request(pipeline, f"joint-{i}", prompt))
    while not scheduler.idle:
        scheduler.iterate()
    scheduler.close()
    assert [got[f"joint-{i}"] for i in range(len(PROMPTS))] == [solo[i] for i in range(len(PROMPTS))]
    assert len(waited) >= 7 and all(waited)


@pytest.mark.parametrize("where", ["sampling", "streaming"])
def test_an_iteration_that_fails_answers_every_turn_and_loses_no_session(pipeline, monkeypatch, where) -> None:  # type: ignore[no-untyped-def]
    """An unexpected failure inside an iteration (sampling raises on the 12th token, or streaming it does, while that
    step's encoder call runs) used to leave the turns in flight unanswered, their clients waiting forever. Now every
    turn in flight gets the error at once, the encoder rolls each back (after the call in flight), the scheduler goes
    on, and each session's resent turn gets exactly the reply it would have got."""
    from tritonserver_backend.errors import TurnFailed

    sessions = [f"fail-{where}-{i}" for i in range(len(PROMPTS))]
    first = {s: pipeline.answer(_request(pipeline, s, p)).token_ids for s, p in zip(sessions, PROMPTS)}
    for s, p in zip(sessions, PROMPTS):  # the same conversations, undisturbed, for reference
        pipeline.answer(_request(pipeline, f"ref-{s}", p))
    expected = {s: pipeline.answer(_request(pipeline, f"ref-{s}", "And then?")).token_ids for s in sessions}
    assert all(first.values())

    failures: dict[str, BaseException] = {}
    calls: list[str] = []

    def breaks(what: str) -> None:
        calls.append(what)
        if len(calls) == 12:
            raise RuntimeError(f"{where} broke")

    def emit(turn: Turn, token: int, reason: str) -> bool:
        if where == "streaming" and token >= 0:
            breaks("emit")
        return True

    scheduler = TurnScheduler(pipeline.decoder, DirectEncoderPort(pipeline.encoder), emit,
                              lambda item, exc: failures.__setitem__(item.session_id, exc))
    real_choose = pipeline.decoder.choose

    def choose(turn: Turn) -> int | None:
        if where == "sampling":
            breaks("choose")
        return real_choose(turn)

    monkeypatch.setattr(pipeline.decoder, "choose", choose)
    for s in sessions:
        scheduler.submit(_request(pipeline, s, "And then?"))
    for _ in range(100):
        if scheduler.idle:
            break
        scheduler.iterate()
    assert scheduler.idle
    assert set(failures) == set(sessions)
    assert all(isinstance(e, TurnFailed) and f"{where} broke" in str(e) and "resend" in str(e)
               for e in failures.values())
    monkeypatch.setattr(pipeline.decoder, "choose", real_choose)

    resent = {s: pipeline.answer(_request(pipeline, s, "And then?")).token_ids for s in sessions}
    scheduler.close()
    assert resent == expected


def test_a_turn_whose_check_fails_unexpectedly_is_answered_and_the_others_go_on(pipeline, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A turn taken from the queue whose check raises something unexpected (not a TurnRejected) used to be lost: it was
    neither waiting nor active any more, so nobody answered it. Now it gets TurnFailed and is rolled back, the turns
    admitted with it decode as they would alone, and its resent turn gets the reply it would have got."""
    from tritonserver_backend.errors import TurnFailed

    sessions = [f"check-{i}" for i in range(len(PROMPTS))]
    solo = {s: pipeline.answer(_request(pipeline, f"ref-{s}", p)).token_ids for s, p in zip(sessions, PROMPTS)}
    real_prepare = pipeline.decoder.prepare

    def prepare(session_id, *args):  # type: ignore[no-untyped-def]
        if session_id == "check-1":
            raise KeyError("a bug")
        return real_prepare(session_id, *args)

    monkeypatch.setattr(pipeline.decoder, "prepare", prepare)
    got: dict[str, list[int]] = {s: [] for s in sessions}
    failures: dict[str, BaseException] = {}

    def emit(turn: Turn, token: int, reason: str) -> bool:
        if token >= 0:
            got[turn.session_id].append(token)
        return True

    scheduler = TurnScheduler(pipeline.decoder, DirectEncoderPort(pipeline.encoder), emit,
                              lambda item, exc: failures.__setitem__(item.session_id, exc))
    for s, p in zip(sessions, PROMPTS):
        scheduler.submit(_request(pipeline, s, p))
    for _ in range(100):
        if scheduler.idle:
            break
        scheduler.iterate()
    scheduler.close()
    assert scheduler.idle and set(failures) == {"check-1"}
    assert isinstance(failures["check-1"], TurnFailed) and "a bug" in str(failures["check-1"])
    assert got["check-0"] == solo["check-0"] and got["check-2"] == solo["check-2"]
    monkeypatch.setattr(pipeline.decoder, "prepare", real_prepare)
    assert pipeline.answer(_request(pipeline, "check-1", PROMPTS[1])).token_ids == solo["check-1"]


def test_starting_turns_join_a_decoding_batch_within_the_replay_budget(pipeline) -> None:  # type: ignore[no-untyped-def]
    """While a turn decodes, the turns waiting to start join at about `replay_budget` replayed positions per iteration
    (one short prompt's replay here), not all at once; each still gets its solo tokens. With nothing decoding they all
    join in one iteration."""
    prompts = ["Tell me a story.", *PROMPTS]
    solo = [pipeline.answer(_request(pipeline, f"budget-solo-{i}", p)).token_ids for i, p in enumerate(prompts)]
    got: dict[str, list[int]] = {f"budget-{i}": [] for i in range(len(prompts))}

    def emit(turn: Turn, token: int, reason: str) -> bool:
        if token >= 0:
            got[turn.session_id].append(token)
        return True

    scheduler = TurnScheduler(pipeline.decoder, DirectEncoderPort(pipeline.encoder), emit,
                              lambda _, exc: pytest.fail(repr(exc)), replay_budget=1)
    scheduler.submit(_request(pipeline, "budget-0", prompts[0]))
    scheduler.iterate()
    assert len(scheduler.active) == 1  # nothing was decoding: it joined at once
    for i, prompt in enumerate(prompts[1:], 1):
        scheduler.submit(_request(pipeline, f"budget-{i}", prompt))
    still_waiting = []
    while not scheduler.idle:
        scheduler.iterate()
        still_waiting.append(len(scheduler.waiting))
    scheduler.close()
    assert still_waiting[:3] == [2, 1, 0]  # one joiner per iteration
    assert [len(got[f"budget-{i}"]) > 0 for i in range(len(prompts))] == [True] * len(prompts)
    assert [got[f"budget-{i}"] for i in range(len(prompts))] == solo
    with pytest.raises(ValueError, match="replay budget"):
        TurnScheduler(pipeline.decoder, DirectEncoderPort(pipeline.encoder), emit, lambda *_: None, replay_budget=-1)
