"""The Triton-free serving library: session store, sampling, registry, hand-over codec, router, pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import EMBEDDED
from tests.tiny import PROJECT_ROOT
from tritonserver_backend import contract as c
from tritonserver_backend.adapters.registry import Registry
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.session_store import SessionStore
from tritonserver_backend.errors import BadRequest, UnknownAdapter, UnknownSession
from tritonserver_backend.repository import render
from tritonserver_backend.sampling.sampler import Sampler, SamplingParams
from tritonserver_backend.triton.handover_codec import rows_from_arrays, to_arrays


def test_session_store_evicts_least_recently_used_over_budget() -> None:
    store: SessionStore[bytes] = SessionStore(budget_bytes=10, size_of=len)
    store.put("a", b"xxxx")
    store.put("b", b"xxxx")
    store.get("a")  # a is now the most recent
    assert store.put("c", b"xxxx") == ["b"]
    with pytest.raises(UnknownSession, match="session 'b' was evicted"):
        store.get("b")
    store.end("a")
    with pytest.raises(UnknownSession, match="session 'a' was ended"):
        store.get("a")
    with pytest.raises(UnknownSession, match="unknown session 'zz'.*history"):
        store.get("zz")


def test_sampling_is_greedy_at_zero_temperature_and_seeded_otherwise() -> None:
    logits = torch.randn(50)
    assert Sampler(SamplingParams())(logits) == int(logits.argmax())
    draws = [Sampler(SamplingParams(temperature=1.0, seed=s))(logits) for s in range(20)]
    again = [Sampler(SamplingParams(temperature=1.0, seed=s))(logits) for s in range(20)]
    assert draws == again and len(set(draws)) > 1
    top = int(logits.argmax())
    assert all(Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=s))(logits) == top for s in range(10))


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(max_tokens=-1), "max_tokens must lie in"), (dict(temperature=-1.0), "temperature"),
     (dict(top_p=0.0), "top_p"), (dict(stop=("",)), "stop strings")],
)
def test_bad_sampling_parameters(kwargs: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        SamplingParams(**kwargs)


def test_registry_round_trip_and_errors(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    entry = reg.put("L2_code", "adapters/L2_code", "writes Python")
    assert reg.by_hash(entry.hash) == entry and reg.by_hash(0) is None and reg.name_of(0) == "base"
    other = Registry(tmp_path)  # another process sees the change
    assert other.by_name("L2_code").path == "adapters/L2_code"
    with pytest.raises(BadRequest, match="already registered as 'L2_code'"):
        reg.put("copy", "adapters/L2_code", "")
    reg.remove("L2_code")
    other.refresh()
    with pytest.raises(UnknownAdapter, match="unknown adapter 'L2_code'"):
        other.by_name("L2_code")
    with pytest.raises(UnknownAdapter, match=f"adapter hash {entry.hash} is not loaded"):
        other.by_hash(entry.hash)


def test_handover_codec_round_trip_and_malformed_tensors(net) -> None:  # type: ignore[no-untyped-def]
    from ced.steps.encoder_step import EncoderStep
    from ced.steps.layout import StepLayout
    from ced.steps.parity import encoder_case, torch_runner

    layout = StepLayout(net.cfg)
    enc, _ = net.split()
    run = torch_runner(EncoderStep(enc).eval(), layout.encoder_inputs(), layout.encoder_outputs())
    feed = encoder_case(layout, run, (13, 7), seed=0)
    out = run(feed)
    parts = [{**{k: out[k][0, :n] for k in ("streams", "ffn_pre", "topk", "candidates", "global_kv", "index_k")},
              "positions": np.arange(13, 13 + n)} for n in (3, 7)]  # two sessions' rows stacked
    arrays = to_arrays(parts)
    back = rows_from_arrays(arrays, [3, 7])
    for got, want in zip(back, parts):
        for field in ("positions", "streams", "ffn_pre", "topk", "candidates", "global_kv", "index_k"):
            assert np.array_equal(got[field], want[field])
    bad = dict(arrays)
    bad[c.HANDOVER_STREAMS.name] = arrays[c.HANDOVER_STREAMS.name][:3]
    with pytest.raises(BadRequest, match="HANDOVER_STREAMS has shape"):
        rows_from_arrays(bad)
    bad = dict(arrays)
    bad[c.HANDOVER_TOPK.name] = arrays[c.HANDOVER_TOPK.name].astype(np.float32)
    with pytest.raises(BadRequest, match="HANDOVER_TOPK"):
        rows_from_arrays(bad)
    with pytest.raises(BadRequest, match="expected 9"):
        rows_from_arrays(arrays, [3, 6])
    del bad[c.HANDOVER_TOPK.name]
    with pytest.raises(BadRequest, match="lacks tensors"):
        rows_from_arrays(bad)


def test_serving_doc_carries_the_current_contract() -> None:
    from tritonserver_backend.repository import contract_markdown

    doc = (PROJECT_ROOT / "docs" / "serving.md").read_text()
    assert contract_markdown() in doc, "docs/serving.md is stale: paste contract_markdown() again"


def test_committed_configs_match_the_contract() -> None:
    root = PROJECT_ROOT / "model_repository"
    for path, text in render(root).items():
        assert path.read_text() == text, (
            f"{path} is stale: run python -m tritonserver_backend.repository --out model_repository --force")
        assert (path.parent / "1").is_dir()
    for model in c.MODELS:
        assert (root / model.name / "1" / "model.py").exists()


# ------------------------------------------------------------------------------------- on the embedded default
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tritonserver_backend.adapters.registry_init import ensure_registry
    from tritonserver_backend.core.pipeline import InProcessPipeline

    root = tmp_path_factory.mktemp("registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root)


def test_router_explicit_adapter_wins_in_a_mixed_batch(pipeline) -> None:  # type: ignore[no-untyped-def]
    router = pipeline.router
    rows = [np.random.randn(router.embed.shape[1]).astype(np.float32) for _ in range(4)]
    routed = router.route(rows, [None] * 4)
    names = router.registry.entries()
    explicit = ["", names[0].name, "", "base"]
    mixed = router.route(rows, [e or None for e in explicit])
    assert mixed[0] == routed[0] and mixed[2] == routed[2]
    assert mixed[1] == names[0].hash and mixed[3] == 0
    bad = router.route(rows[:1], ["L9"])
    assert isinstance(bad[0], UnknownAdapter)


def test_the_router_follows_changes_made_through_a_registry_it_shares(pipeline) -> None:  # type: ignore[no-untyped-def]
    """A Registry object shared by the router and a writer (the admin service in one process, as
    benchmarks/zero_shot_adapter.py runs them): a change the shared object has already re-read must still reach the
    router's option cache (it used to keep routing over the old adapter set: unloaded adapters, no new ones)."""
    from tritonserver_backend.core.router_service import RouterService

    registry = pipeline.registry
    router = RouterService(EMBEDDED, registry, engine=pipeline.engine)  # as benchmarks/zero_shot_adapter.py builds it
    entries = registry.entries()
    keep = entries[0]
    rows = [np.random.default_rng(i).standard_normal(router.embed.shape[1]).astype(np.float32) for i in range(32)]
    try:
        for e in entries[1:]:
            registry.remove(e.name)  # the shared object re-reads the file itself here
        assert router.route(rows, [None] * len(rows)) == [keep.hash] * len(rows)
    finally:
        for e in entries[1:]:
            registry.put(e.name, e.path, e.description)
    loaded = {e.hash for e in registry.entries()}
    assert len(loaded) == len(entries)
    assert set(router.route(rows, [None] * len(rows))) <= loaded


def test_pipeline_errors_lose_nothing(pipeline) -> None:  # type: ignore[no-untyped-def]
    counts = [pipeline.counters.get(name) for name in (k.WRITTEN, k.READ, k.APPLIED)]
    first = pipeline.chat("keep", "Hello, how are you?", new_session=True, params=SamplingParams(max_tokens=4))
    before = (pipeline.encoder.sessions.get("keep").position, pipeline.decoder.sessions.get("keep").position)
    with pytest.raises(UnknownAdapter):
        pipeline.chat("keep", "x", adapter="no_such_adapter")
    with pytest.raises(UnknownSession):
        pipeline.chat("never_started", "x")
    with pytest.raises(BadRequest, match="context limit"):
        pipeline.chat("keep", "word " * 9000)
    assert (pipeline.encoder.sessions.get("keep").position, pipeline.decoder.sessions.get("keep").position) == before
    assert first.finish_reason in ("length", "end_of_turn", "stop")
    written, read, applied = (pipeline.counters.get(name) - n
                              for name, n in zip((k.WRITTEN, k.READ, k.APPLIED), counts))
    assert written == read == applied == 1, "only the successful turn reached the router and the decoder"


def test_history_rebuilds_a_lost_session(pipeline) -> None:  # type: ignore[no-untyped-def]
    """A fresh session id given the conversation as `history` answers the next turn exactly (token ids, greedy) as
    the same conversation held undisturbed in its own session does; a session without that history answers
    differently, so the equality is the history's doing and a rebuild that dropped or garbled it would fail."""
    params = SamplingParams(max_tokens=12)
    first, then = "Tell me about ships.", "And the sea?"
    a = pipeline.chat("orig", first, new_session=True, params=params)
    # history carries text: the rebuild can hold the same ids only where the reply's text encodes back to them (at
    # 8 tokens this reply ends in two "\n" tokens, which encode back as one "\n\n")
    assert pipeline.text.tokenizer.encode(a.text) == a.token_ids, "pick a reply whose text encodes back to its ids"
    history = json.dumps([{"role": "user", "content": first}, {"role": "assistant", "content": a.text}])
    undisturbed = pipeline.chat("orig", then, params=params, adapter="base")
    rebuilt = pipeline.chat("rebuilt", then, history=history, params=params, adapter="base")
    assert undisturbed.token_ids, "the undisturbed reply is empty: the comparison below would prove nothing"
    assert rebuilt.token_ids == undisturbed.token_ids, (rebuilt.token_ids, undisturbed.token_ids)
    assert (rebuilt.adapter, rebuilt.finish_reason) == (undisturbed.adapter, undisturbed.finish_reason)
    held = [(pipeline.encoder.sessions.get(sid).position, pipeline.decoder.sessions.get(sid).position)
            for sid in ("orig", "rebuilt")]
    assert held[0] == held[1], f"the rebuilt session holds other positions than the undisturbed one: {held}"
    no_history = pipeline.chat("no-history", then, new_session=True, params=params, adapter="base")
    assert no_history.token_ids != undisturbed.token_ids, "the history must change this reply for the test to tell"
    with pytest.raises(BadRequest, match="history is not valid JSON"):
        pipeline.chat("other", "x", history="[not json")


def test_a_turn_rejected_by_the_decoder_is_rolled_back(pipeline) -> None:  # type: ignore[no-untyped-def]
    """An adapter unloaded between the router's decision and the decoder: clear error, nothing lost."""
    from tritonserver_backend.adapters.registry_init import description_of
    from tritonserver_backend.core.scheduler import TurnStart
    from tritonserver_backend.errors import TurnRejected

    params = SamplingParams(max_tokens=3)
    pipeline.chat("race", "Hello there.", new_session=True, params=params)
    before = (pipeline.encoder.sessions.get("race").position, pipeline.decoder.sessions.get("race").position)
    ids, prefix, start = pipeline.text.preprocess("Style this button.", False, None)
    encoded = pipeline.encoder.encode_turn("race", ids, prefix, start)
    h19, handover = encoded.h19, encoded.handover
    decided = pipeline.router.route([h19], ["L3_design"])[0]
    entry = pipeline.registry.by_name("L3_design")
    pipeline.registry.remove("L3_design")
    try:
        with pytest.raises(TurnRejected, match=f"adapter hash {decided} is not loaded"):
            pipeline.answer(TurnStart("race", handover, decided, params))  # the scheduler rolls the encoder back
        assert (pipeline.encoder.sessions.get("race").position,
                pipeline.decoder.sessions.get("race").position) == before
        assert pipeline.chat("race", "Style this button.", params=params).token_ids, "the session goes on"
    finally:
        pipeline.registry.put("L3_design", entry.path, entry.description)
    assert description_of(EMBEDDED / "adapters" / "L3_design")


def test_session_state_does_not_grow_with_the_adapters_it_visits(pipeline) -> None:  # type: ignore[no-untyped-def]
    """One history for every adapter: a session that visits four adapters holds exactly the arrays (shapes and bytes)
    of a twin that stays on one, once both hold the same positions; only the one set of decoder rings is adapter-
    dependent, and a switch rebuilds it in place (docs/benchmarks.md measures the same on the served engines)."""
    params = SamplingParams(max_tokens=4)
    texts = ["Hello, how are you?", "def f(x):\n    return x", "Make the title bold.", "ls -la /tmp"]
    adapters = [e.name for e in pipeline.registry.entries()][:4]
    for i, text in enumerate(texts):
        pipeline.chat("visits", text, adapter=adapters[i % len(adapters)], new_session=i == 0, params=params)
        pipeline.chat("stays", text, adapter=adapters[0], new_session=i == 0, params=params)

    def state(sid: str) -> tuple[int, list[tuple[int, ...]], int]:
        enc, dec = pipeline.encoder.sessions.get(sid), pipeline.decoder.sessions.get(sid)
        shapes = [enc.rings.shape, *(a.shape for a in enc.kv.values()), dec.kv.shape, dec.rings.shape,
                  *(a.shape for a in dec.recent.values())]
        return dec.position, shapes, enc.nbytes() + dec.nbytes()

    visits, stays = state("visits"), state("stays")
    assert visits[0] == stays[0], (
        f"the twins must hold the same positions (replies ended early: {visits[0]} vs {stays[0]})")
    assert visits == stays
