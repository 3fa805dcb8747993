"""Source independence where the serving path computes it: a turn under target T after a turn under adapter A equals,
bit for bit in its log-probabilities, the same turn on a session rebuilt from the identical history, whatever A was.

The engine-level tests prove the shared state is adapter-free; this proves the services use it that way: the
decoder replays the new turn under its own adapter, never the one that answered before (an outside review planted
exactly that bug and the whole suite passed). In process on the served onnx engines, alone and with other sessions'
turns batched beside it; `test_serving_exactness.py` runs the same check through a real tritonserver.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.tritonserver_backend.in_process import onnx_pipeline
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.decoder_service import TokenLogprobs
from tritonserver_backend.core.pipeline import DirectEncoderPort, InProcessPipeline, TurnResult
from tritonserver_backend.core.scheduler import TurnScheduler, TurnStart
from tritonserver_backend.sampling.sampler import SamplingParams

pytestmark = pytest.mark.slow

FIRST = "def mean(xs):\n    return sum(xs) / len(xs)"
SECOND = "Make the header sticky with a shadow."
SOURCES = ("base", "L0_chat", "L1_agent", "L2_code")
TARGET = "L3_design"
FIRST_PARAMS = SamplingParams(max_tokens=8)
PROBED = SamplingParams(max_tokens=6, logprobs=True, top_logprobs=8)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, default_engines) -> InProcessPipeline:  # type: ignore[no-untyped-def]
    return onnx_pipeline(tmp_path_factory, default_engines)


def history_of(pipeline: InProcessPipeline, first: TurnResult) -> str:
    """The first exchange as `history` JSON; the reply's text must tokenize back to its ids, or the rebuilt session
    would not hold the identical history and the comparison would prove nothing."""
    assert pipeline.text.tokenizer.encode(first.text) == first.token_ids, "the reply does not round-trip its text"
    return json.dumps([{"role": "user", "content": FIRST}, {"role": "assistant", "content": first.text}])


def assert_same_bits(got: list[TokenLogprobs], want: list[TokenLogprobs], what: str) -> None:
    """Log-probabilities (each token's and the top 8 at every position), compared as float32 bit patterns."""
    assert len(got) == len(want) > 0, what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.top_ids == w.top_ids, f"{what}: position {i} ranks other tokens"
        bits = [np.asarray([e.logprob, *e.top_logprobs], np.float32).view(np.uint32) for e in (g, w)]
        np.testing.assert_array_equal(bits[0], bits[1], err_msg=f"{what}: position {i}")


def test_the_turn_after_any_source_adapter_equals_a_rebuilt_session(pipeline) -> None:  # type: ignore[no-untyped-def]
    replies = {}
    for source in SOURCES:
        sid = f"source-{source}"
        first = pipeline.chat(sid, FIRST, adapter=source, new_session=True, params=FIRST_PARAMS)
        assert first.adapter == source
        got = pipeline.chat(sid, SECOND, adapter=TARGET, params=PROBED)
        rebuilt = pipeline.chat(f"rebuilt-{source}", SECOND, adapter=TARGET, new_session=True,
                                history=history_of(pipeline, first), params=PROBED)
        assert got.adapter == rebuilt.adapter == TARGET
        assert got.token_ids == rebuilt.token_ids, source
        assert_same_bits(got.logprobs, rebuilt.logprobs, f"after {source}")
        replies[source] = first.token_ids
    assert len({tuple(v) for v in replies.values()}) > 1, "the source adapters wrote different histories"


def test_source_independence_holds_with_other_sessions_batched_beside_it(pipeline) -> None:  # type: ignore[no-untyped-def]
    """The probed turns start together with other sessions' turns (their replays share one call, their decode steps
    share batches); each probed turn still equals its rebuilt session's solo run bit for bit."""
    firsts = {s: pipeline.chat(f"batched-{s}", FIRST, adapter=s, new_session=True, params=FIRST_PARAMS)
              for s in SOURCES}
    solo = {s: pipeline.chat(f"solo-rebuilt-{s}", SECOND, adapter=TARGET, new_session=True,
                             history=history_of(pipeline, firsts[s]), params=PROBED) for s in SOURCES}
    requests = [_request(pipeline, f"batched-{s}", SECOND, TARGET, False, None, PROBED) for s in SOURCES]
    noise = ["How do I undo a git commit?", "Write a haiku about tea.", FIRST]
    requests += [_request(pipeline, f"noise-{i}", text, None, True, None, SamplingParams(max_tokens=10))
                 for i, text in enumerate(noise)]
    results, rows_per_step = _run_together(pipeline, requests)
    assert rows_per_step >= 3, f"the turns were not batched ({rows_per_step:.2f} rows per decode step)"
    for s in SOURCES:
        got = results[f"batched-{s}"]
        assert got[0] == solo[s].token_ids, s
        assert_same_bits(got[1], solo[s].logprobs, f"batched, after {s}")


def _request(pipeline: InProcessPipeline, sid: str, text: str, adapter: str | None, new: bool, history: str | None,
             params: SamplingParams) -> TurnStart:
    """A turn encoded and routed the way the ensemble does before the decoder sees it."""
    ids, prefix, start = pipeline.text.preprocess(text, new, history)
    encoded = pipeline.encoder.encode_turn(sid, ids, prefix, start)
    h19, handover = encoded.h19, encoded.handover
    routed = pipeline.router.route([h19], [adapter])[0]
    assert not isinstance(routed, Exception), routed
    return TurnStart(sid, handover, int(routed), params)


def _run_together(pipeline: InProcessPipeline, requests: list[TurnStart]) -> tuple[dict, list[int]]:
    """Every request submitted at once to one scheduler -> ({session: (tokens, logprobs)}, mean rows per decode step,
    read from the decoder's batching counters)."""
    tokens: dict[str, list[int]] = {r.session_id: [] for r in requests}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    failures: list[BaseException] = []

    def emit(turn, token: int, reason: str) -> bool:  # type: ignore[no-untyped-def]
        if token >= 0:
            tokens[turn.session_id].append(token)
        logprobs[turn.session_id] = list(turn.logprobs)
        return True

    scheduler = TurnScheduler(pipeline.decoder, DirectEncoderPort(pipeline.encoder), emit,
                              lambda _, exc: failures.append(exc), max_active=16)
    before = [pipeline.counters.get(name, k.DECODE) for name in (k.DECODER_STEPS, k.DECODER_ROWS)]
    try:
        for r in requests:
            scheduler.submit(r)
        while not scheduler.idle:
            scheduler.iterate()
    finally:
        scheduler.close()
    assert not failures, failures
    steps, rows = (pipeline.counters.get(name, k.DECODE) - b
                   for name, b in zip((k.DECODER_STEPS, k.DECODER_ROWS), before))
    return {sid: (tokens[sid], logprobs.get(sid, [])) for sid in tokens}, rows / max(steps, 1)
