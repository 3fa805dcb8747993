"""Speculative decoding through the serving path, in process on the served onnx engines: greedy replies with drafting
equal the plain replies token for token, and every session's state after them equals, bit for bit, the state the
plain run leaves (encoder rows and decoder rows). Multi-turn conversations with adapter switches (the bounded replay
under the new adapter runs on the state the speculative turns left), turns batched with mixed adapters, and turns
that end inside a block (max_tokens, a stop string) are covered. `test_serving_speculative.py` runs the exactness
check through a real tritonserver.

Three drafters: the embedded default's own DSpark drafter (the engines' drafter graph over each turn's ring of
`draft_main` rows), prompt lookup over the reply (`NgramDrafter`), and a drafter that is always wrong (every block
rejected at its first draft must still give the plain reply). The DSpark ring itself is checked too: after any
mix of accepted and rejected blocks it holds, bit for bit, the rows a plain run computes for the same positions.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.tritonserver_backend.in_process import onnx_pipeline
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.drafting import DSparkDrafter, NgramDrafter
from tritonserver_backend.core.pipeline import DirectEncoderPort, InProcessPipeline
from tritonserver_backend.core.scheduler import TurnScheduler, TurnStart
from tritonserver_backend.sampling.sampler import SamplingParams

pytestmark = pytest.mark.slow

CONVERSATION = [  # (user turn, adapter: None = routed)
    ("Write a haiku about the sea.", None),
    ("Now as a python function that prints it.", "L2_code"),
    ("Explain what the function does.", "L0_chat"),
    ("Make the page header sticky.", "L3_design"),
]
PARAMS = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, default_engines) -> InProcessPipeline:  # type: ignore[no-untyped-def]
    return onnx_pipeline(tmp_path_factory, default_engines)


class WrongDrafter:
    """Drafts a token the target never picks first (the one after its last token, mod the vocabulary): every block
    is cut at its first draft, the hardest case for the rollback."""

    name, block = "wrong", 3

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, turns, counts) -> list[list[int]]:  # type: ignore[no-untyped-def]
        return [[(t.generated[-1] + 1 + i) % self.vocab for i in range(min(c, self.block))]
                for t, c in zip(turns, counts)]


class RingRecorder:
    """Wraps a drafter (None: proposes nothing, so every step is plain) and records, at every proposal, each turn's
    DSpark ring: (newest position, last token) -> the ring's rows."""

    name, block = "recorder", 4

    def __init__(self, inner=None) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.rings: dict[tuple[int, int], np.ndarray] = {}

    def propose(self, turns, counts) -> list[list[int]]:  # type: ignore[no-untyped-def]
        for t in turns:
            assert t.draft_ring is not None
            self.rings[(t.draft_ring.last_position, t.generated[-1])] = t.draft_ring.rows.copy()
        return self.inner.propose(turns, counts) if self.inner else [[] for _ in turns]


def make(pipeline: InProcessPipeline, drafter: str):  # type: ignore[no-untyped-def]
    if drafter == "dspark":
        assert pipeline.engine.has_drafter, "the embedded default ships a DSpark drafter (embedded/mol2-small/drafter)"
        return DSparkDrafter(pipeline.engine, block=4)
    return NgramDrafter(block=4) if drafter == "ngram" else WrongDrafter(pipeline.engine.cfg.vocab_size)


def converse(pipeline: InProcessPipeline, session: str, params: SamplingParams = PARAMS) -> list[list[int]]:
    replies = []
    for i, (text, adapter) in enumerate(CONVERSATION):
        replies.append(pipeline.chat(session, text, adapter=adapter, new_session=i == 0, params=params).token_ids)
    return replies


def assert_same_state(pipeline: InProcessPipeline, got: str, want: str) -> None:
    """Both sides of two sessions, array by array, bit for bit."""
    for side in (pipeline.encoder.sessions, pipeline.decoder.sessions):
        a, b = side.get(got), side.get(want)
        assert a.position == b.position
        for name, value in vars(a).items():
            other = vars(b)[name]
            arrays = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
            others = other.values() if isinstance(other, dict) else other if isinstance(other, list) else [other]
            for x, y in zip(arrays, others):
                if isinstance(x, np.ndarray):
                    assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), (
                        f"{type(a).__name__}.{name}")
                else:
                    assert x == y, f"{type(a).__name__}.{name}"


@pytest.mark.parametrize("drafter", ["dspark", "ngram", "wrong"])
def test_greedy_speculative_replies_and_state_equal_plain_decoding(pipeline, drafter: str) -> None:  # type: ignore[no-untyped-def]
    pipeline.drafter = None
    plain = converse(pipeline, f"plain-{drafter}")
    before = {c: pipeline.counters.get(c) for c in (k.SPECULATIVE_BLOCKS, k.DRAFTED, k.DRAFTS_ACCEPTED)}
    pipeline.drafter = make(pipeline, drafter)
    try:
        speculative = converse(pipeline, f"spec-{drafter}")
    finally:
        pipeline.drafter = None
    assert speculative == plain
    assert_same_state(pipeline, f"spec-{drafter}", f"plain-{drafter}")
    blocks, drafted, accepted = (pipeline.counters.get(c) - before[c]
                                 for c in (k.SPECULATIVE_BLOCKS, k.DRAFTED, k.DRAFTS_ACCEPTED))
    assert blocks > 0 and drafted >= blocks
    if drafter == "wrong":
        assert accepted == 0
    else:
        assert accepted > 0  # the default repeats itself (prompt lookup is right often); DSpark was trained on it
        assert sum(len(r) for r in plain) > accepted


def test_the_dspark_ring_holds_exactly_the_plain_rows_of_the_kept_positions(pipeline) -> None:  # type: ignore[no-untyped-def]
    """Every ring a speculative run drafts from (after accepted and rejected blocks, adapter switches and new turns)
    equals, bit for bit, the ring a plain run holds at the same position: a rejected draft's row never enters it,
    and a kept row is the row one-token steps compute (the decoder is chunk-invariant)."""
    plain, spec = RingRecorder(), RingRecorder(make(pipeline, "dspark"))
    for name, recorder in (("ring-plain", plain), ("ring-spec", spec)):
        pipeline.drafter = recorder
        try:
            converse(pipeline, name)
        finally:
            pipeline.drafter = None
    assert len(spec.rings) > 8 and set(spec.rings) < set(plain.rings)  # fewer proposals: blocks were accepted
    for key, rows in spec.rings.items():
        want = plain.rings[key]
        assert rows.shape == want.shape and np.array_equal(rows.view(np.uint8), want.view(np.uint8)), key


def test_a_turn_that_ends_inside_a_block_stops_where_plain_decoding_stops(pipeline) -> None:  # type: ignore[no-untyped-def]
    """max_tokens and a stop string reached in the middle of accepted drafts: the reply, its finish and the state
    that the next turn continues from are those of plain decoding."""
    pipeline.drafter = None
    full = pipeline.chat("probe", CONVERSATION[0][0], new_session=True, params=PARAMS)
    pipeline.end("probe")
    stop = pipeline.text.decode(full.token_ids[5:8])
    for i, params in enumerate([SamplingParams(max_tokens=7), SamplingParams(max_tokens=24, stop=(stop,))]):
        replies = {}
        for mode, drafter in (("plain", None), ("spec", NgramDrafter(block=4))):
            pipeline.drafter = drafter
            session = f"cut-{i}-{mode}"
            first = pipeline.chat(session, CONVERSATION[0][0], new_session=True, params=params)
            second = pipeline.chat(session, CONVERSATION[1][0], adapter="L2_code", params=PARAMS)
            replies[mode] = (first.token_ids, first.finish_reason, second.token_ids)
        pipeline.drafter = None
        assert replies["spec"] == replies["plain"]
        assert_same_state(pipeline, f"cut-{i}-spec", f"cut-{i}-plain")


def test_batched_turns_with_mixed_adapters_and_opt_outs_equal_their_plain_replies(pipeline) -> None:  # type: ignore[no-untyped-def]
    """Four sessions in one batch, each under another adapter, one of them opting out (`speculative` false: it
    verifies padding it never keeps): every reply equals the session's plain reply alone."""
    adapters = ["L0_chat", "L1_agent", "L2_code", "L3_design"]
    prompts = [text for text, _ in CONVERSATION]
    pipeline.drafter = None
    alone = [pipeline.chat(f"alone-{i}", p, adapter=a, new_session=True, params=PARAMS).token_ids
             for i, (p, a) in enumerate(zip(prompts, adapters))]
    got: dict[str, list[int]] = {f"batch-{i}": [] for i in range(len(prompts))}
    failures: list[BaseException] = []

    def emit(turn, token: int, reason: str) -> bool:  # type: ignore[no-untyped-def]
        if token >= 0:
            got[turn.session_id].append(token)
        return True

    scheduler = TurnScheduler(pipeline.decoder, DirectEncoderPort(pipeline.encoder), emit,
                              lambda _, exc: failures.append(exc), drafter=NgramDrafter(block=4))
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        ids, prefix, start = pipeline.text.render(p, True, None)
        encoded = pipeline.encoder.encode_turn(f"batch-{i}", ids, prefix, start)
        params = SamplingParams(max_tokens=24, speculative=i != 2)
        pipeline.registry.refresh()
        scheduler.submit(TurnStart(f"batch-{i}", encoded.handover, pipeline.registry.by_name(a).hash, params))
    while not scheduler.idle:
        scheduler.iterate()
    scheduler.close()
    assert not failures
    assert [got[f"batch-{i}"] for i in range(len(prompts))] == alone


def test_the_encoder_refuses_a_malformed_keep_and_changes_nothing(pipeline) -> None:  # type: ignore[no-untyped-def]
    from tritonserver_backend.errors import BadRequest

    ids, prefix, start = pipeline.text.render("Hello there.", True, None)
    pipeline.encoder.encode_turn("keep-check", ids, prefix, start)
    position = pipeline.encoder.sessions.get("keep-check").position
    with pytest.raises(BadRequest, match="has no speculative step waiting"):
        pipeline.encoder.encode_step(["keep-check"], np.asarray([[5]]), keep=np.asarray([1]))
    pipeline.encoder.encode_step(["keep-check"], np.asarray([[5, 6, 7]]), draft=True)
    assert pipeline.encoder.sessions.get("keep-check").position == position  # a draft step waits for its kept length
    for bad in ([0], [4], [1, 1]):
        with pytest.raises(BadRequest, match="STEP_KEEP"):
            pipeline.encoder.encode_step(["keep-check"], np.asarray([[9]]), keep=np.asarray(bad))
    pipeline.encoder.encode_step(["keep-check"], np.asarray([[9]]), keep=np.asarray([2]))
    assert pipeline.encoder.sessions.get("keep-check").position == position + 3  # two kept, then the new token
    pipeline.encoder.rollback("keep-check")


@pytest.mark.parametrize("drafter", ["dspark", "ngram"])
def test_sampled_turns_with_drafting_are_the_plain_draws(pipeline, drafter: str) -> None:  # type: ignore[no-untyped-def]
    """At temperature > 0 a draft is kept while the turn's own seeded draw equals it (speculative sampling for a
    one-hot drafter, docs/speculative.md): the generator is consumed as without drafting, so a seeded reply with
    drafting is the plain reply token for token, and so is a turn that opts out."""
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=11)
    pipeline.drafter = None
    plain = pipeline.chat("sampled-plain", CONVERSATION[0][0], new_session=True, params=sampled).token_ids
    blocks = pipeline.counters.get(k.SPECULATIVE_BLOCKS)
    pipeline.drafter = make(pipeline, drafter)
    try:
        runs = [pipeline.chat(f"sampled-{drafter}-{i}", CONVERSATION[0][0], new_session=True, params=sampled).token_ids
                for i in range(2)]
        opted_out = pipeline.chat(f"sampled-{drafter}-out", CONVERSATION[0][0], new_session=True,
                                  params=SamplingParams(max_tokens=24, temperature=0.8, seed=11,
                                                        speculative=False)).token_ids
    finally:
        pipeline.drafter = None
    assert runs[0] == runs[1] == plain and len(plain) > 0
    assert opted_out == plain
    assert pipeline.counters.get(k.SPECULATIVE_BLOCKS) > blocks  # the sampled turns did draft
