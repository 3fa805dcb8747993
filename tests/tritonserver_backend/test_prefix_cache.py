"""The encoder's prefix cache (issue 49, first part): a starting session that shares a prefix with an earlier one
takes its encoder state and hand-over rows from the cache and prefills only the rest, and everything after is the
same bits as a cold prefill: the rows, H19 (routing), and the replies and log-probabilities under every adapter.
Partitions (cache_salt) never see each other's prefixes; the budget evicts the least recently used."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ced.steps.rows import HANDOVER_KEYS
from tests.conftest import EMBEDDED
from tests.tritonserver_backend.streams import start_server
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.client import GrpcChat, TurnRequest
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.encoder_service import EncoderService
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.core.prefix_cache import PrefixCache
from tritonserver_backend.engines import open_engine
from tritonserver_backend.errors import BadRequest
from tritonserver_backend.sampling.sampler import SamplingParams

CHUNK = 256
ADAPTERS = ("L0_chat", "L1_agent", "L2_code", "L3_design")


@pytest.fixture(scope="module")
def engine(default_engines: Path):  # type: ignore[no-untyped-def]
    return open_engine("onnx", EMBEDDED, default_engines)


def prompt(seed: int, length: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, vocab, length).astype(np.int64)


def assert_same_rows(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    for key in (*HANDOVER_KEYS, "positions"):
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def assert_same_state(a, b, layout) -> None:  # type: ignore[no-untyped-def]
    assert a.position == b.position
    assert np.array_equal(a.rings, b.rings) and np.array_equal(a.engram_recent, b.engram_recent)
    for source in layout.sources:
        n = a.used(layout, source)
        assert np.array_equal(a.kv[source][:n], b.kv[source][:n]), source
        assert np.array_equal(a.index_k[source][:n], b.index_k[source][:n]), source
    for source, pending in a.pending.items():
        assert np.array_equal(pending, b.pending[source]), source


def test_a_hit_prefills_only_the_rest_and_gives_the_cold_bits(engine) -> None:  # type: ignore[no-untyped-def]
    vocab = engine.cfg.vocab_size
    shared, tail_a, tail_b = prompt(0, 600, vocab), prompt(1, 40, vocab), prompt(2, 70, vocab)
    cached = EncoderService(engine, session_auth=False, prefix_cache_bytes=256 << 20)
    cold = EncoderService(engine, session_auth=False)
    first = cached.encode_turn("a", np.concatenate([shared, tail_a]), start=True)
    assert cached.counters.get(k.PREFIX_MISSES) == 1 and len(cached.prefix_cache) == 1  # 512 positions stored
    hit = cached.encode_turn("b", np.concatenate([shared, tail_b]), start=True)
    assert cached.counters.get(k.PREFIX_HITS, k.PREFIX_SHARED) == 1
    assert cached.counters.get(k.PREFIX_HIT_TOKENS) == 512
    assert cached.counters.get(k.ENCODED_TOKENS, k.TURN) == 640 + 670 - 512  # the hit prefilled 158 positions
    reference = cold.encode_turn("b", np.concatenate([shared, tail_b]), start=True)
    assert_same_rows(hit.handover, reference.handover)
    assert hit.h19.tobytes() == reference.h19.tobytes()  # routing reads the same H19
    assert_same_state(cached.sessions.get("b"), cold.sessions.get("b"), engine.layout)
    assert first.handover["positions"].size == 640


def test_the_cache_is_exact_under_every_adapter(default_engines: Path, tmp_path: Path) -> None:
    """A session that starts from the cache answers, under each adapter, with the tokens and log-probability bits
    of the same session prefilled cold (the bounded replay runs under the adapter either way)."""
    document = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times."
                         for i in range(60))
    params = SamplingParams(max_tokens=12, logprobs=True)
    runs = {}
    for cache in (256 << 20, 0):
        root = tmp_path / f"registry{cache}"
        ensure_registry(root, EMBEDDED)
        pipe = InProcessPipeline(EMBEDDED, root, backend="onnx", engine_dir=default_engines, prefix_cache_bytes=cache)
        pipe.chat("warm", document + "\nSummarise it.", new_session=True, params=params)  # fills the cache
        runs[cache] = {a: pipe.chat(f"s-{a}", document + f"\nWhat does line 3 say? ({a})", adapter=a,
                                    new_session=True, params=params) for a in ADAPTERS}
        if cache:
            assert pipe.encoder.counters.get(k.PREFIX_HITS) == len(ADAPTERS)
            assert pipe.encoder.counters.get(k.PREFIX_HIT_TOKENS) >= len(ADAPTERS) * CHUNK
    for adapter in ADAPTERS:
        hit, cold = runs[256 << 20][adapter], runs[0][adapter]
        assert hit.adapter == cold.adapter == adapter
        assert hit.token_ids == cold.token_ids
        assert [lp.logprob for lp in hit.logprobs] == [lp.logprob for lp in cold.logprobs]


def test_a_stranger_with_another_salt_gets_no_hit(engine) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(3, 300, engine.cfg.vocab_size)
    service = EncoderService(engine, session_auth=False, prefix_cache_bytes=256 << 20)
    service.encode_turn("owner", ids, start=True, cache_salt="tenant-a")
    service.encode_turn("stranger", ids, start=True, cache_salt="tenant-b")
    service.encode_turn("shared", ids, start=True)
    assert service.counters.get(k.PREFIX_HITS) == 0 and service.counters.get(k.PREFIX_MISSES) == 3
    service.encode_turn("owner-2", ids, start=True, cache_salt="tenant-a")
    assert service.counters.get(k.PREFIX_HITS, k.PREFIX_SALTED) == 1


@pytest.mark.parametrize("salt", ["x" * 257, "tab\there", b"\xff\xfe"])
def test_a_malformed_cache_salt_is_refused_by_name(engine, salt) -> None:  # type: ignore[no-untyped-def]
    service = EncoderService(engine, session_auth=False, prefix_cache_bytes=256 << 20)
    with pytest.raises(BadRequest, match="cache_salt"):
        service.encode_turn("s", prompt(4, 20, engine.cfg.vocab_size), start=True, cache_salt=salt)
    assert not service.sessions.contains("s")


def test_the_budget_evicts_the_least_recently_used_prefix(engine) -> None:  # type: ignore[no-untyped-def]
    vocab = engine.cfg.vocab_size
    probe = EncoderService(engine, session_auth=False, prefix_cache_bytes=1 << 30)
    probe.encode_turn("p", prompt(5, 260, vocab), start=True)
    one = probe.prefix_cache.total_bytes()
    service = EncoderService(engine, session_auth=False, prefix_cache_bytes=int(one * 1.5))  # room for one entry
    a, b = prompt(6, 260, vocab), prompt(7, 260, vocab)
    service.encode_turn("a", a, start=True)
    service.encode_turn("b", b, start=True)
    assert service.counters.get(k.PREFIX_EVICTIONS) == 1 and len(service.prefix_cache) == 1
    assert service.prefix_cache.total_bytes() <= service.prefix_cache.budget_bytes
    service.encode_turn("b2", b, start=True)
    service.encode_turn("a2", a, start=True)  # a was evicted: a miss
    assert service.counters.get(k.PREFIX_HITS) == 1 and service.counters.get(k.PREFIX_MISSES) == 3


def test_a_rolled_back_turn_leaves_the_cache_whole(engine) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(8, 300, engine.cfg.vocab_size)
    service = EncoderService(engine, session_auth=False, prefix_cache_bytes=256 << 20)
    reference = service.encode_turn("first", ids, start=True)
    service.rollback("first")  # the decoder refused the turn: the session is gone, the cached prefix stays valid
    assert not service.sessions.contains("first") and len(service.prefix_cache) == 1
    again = service.encode_turn("second", ids, start=True)
    assert service.counters.get(k.PREFIX_HITS) == 1
    assert_same_rows(again.handover, reference.handover)


def test_a_prefix_cache_block_must_hold_a_token() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        PrefixCache(0, 1 << 20)


def metric(server, name: str, partition: str) -> float:  # type: ignore[no-untyped-def]
    for line in urllib.request.urlopen(server.metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith(name + "{") and f'partition="{partition}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{partition={partition}}} is not exported")


@pytest.mark.slow
def test_served_sessions_share_a_prefix_and_answer_as_cold(tmp_path: Path, default_engines: Path) -> None:
    """Through a real tritonserver (the cache is on by default): sessions that open with one document under
    different adapters hit the cache and answer with the tokens of a cold in-process prefill; a session with another
    cache_salt does not hit (the counters, not the timing, show it)."""
    document = "\n".join(f"{i}. import os; os.listdir('/srv/data/{i}') and print the sorted names" for i in range(50))
    server = start_server(tmp_path / "server", default_engines, max_context="4096")
    try:
        chat = GrpcChat(server.grpc_url)
        try:
            chat.turn(TurnRequest("warm", document + "\nWhat does it do?", new_session=True, max_tokens=4))
            replies = {a: chat.turn(TurnRequest(f"s-{a}", document + f"\nExplain line 2 ({a}).", new_session=True,
                                                adapter=a, max_tokens=10)) for a in ADAPTERS}
            stranger = chat.turn(TurnRequest("stranger", document + "\nWhat does it do?", new_session=True,
                                             max_tokens=4, cache_salt="someone-else"))
            bad = chat.turn(TurnRequest("bad", "hi", new_session=True, max_tokens=2, cache_salt="x" * 300))
        finally:
            chat.close()
        assert metric(server, "mol2_prefix_cache_hits", "shared") == len(ADAPTERS)
        assert metric(server, "mol2_prefix_cache_hits", "salted") == 0
        assert metric(server, "mol2_prefix_cache_misses", "salted") == 1
    finally:
        server.stop()
    assert not stranger.error and "cache_salt" in (bad.error or "")
    root = tmp_path / "registry-cold"
    ensure_registry(root, EMBEDDED)
    cold = InProcessPipeline(EMBEDDED, root, backend="onnx", engine_dir=default_engines, max_context=4096)
    for adapter, reply in replies.items():
        assert not reply.error, reply.error
        expected = cold.chat(f"s-{adapter}", document + f"\nExplain line 2 ({adapter}).", adapter=adapter,
                             new_session=True, params=SamplingParams(max_tokens=10))
        assert reply.token_ids == expected.token_ids, adapter
