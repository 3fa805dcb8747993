"""The encoder's prefix cache (issue 49, first part): a starting session that shares a prefix with an earlier one
takes its encoder state and hand-over rows from the cache and prefills only the rest, and everything after is the
same bits as a cold prefill: the rows, H19 (routing), and the replies and log-probabilities under every adapter.
Partitions (cache_salt) never see each other's prefixes; the budget evicts the least recently used."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ced.steps.rows import HANDOVER_FIELDS, HANDOVER_KEYS
from tests.conftest import EMBEDDED
from tests.tritonserver_backend.streams import concurrent_token_ids
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.client import GrpcChat, TurnRequest
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.encoder_service import EncoderService
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.core.prefix_cache import PrefixCache
from tritonserver_backend.core.resting_rows import RestingRow, wake
from tritonserver_backend.engines import open_engine
from tritonserver_backend.errors import BadRequest, UnknownSession
from tritonserver_backend.sampling.sampler import SamplingParams

CHUNK = 256
ADAPTERS = ("L0_chat", "L1_agent", "L2_code", "L3_design")
DOCUMENT = "\n".join(f"{i}. import os; os.listdir('/srv/data/{i}') and print the sorted names" for i in range(50))


@pytest.fixture(scope="module")
def engine(default_engines: Path):  # type: ignore[no-untyped-def]
    return open_engine("onnx", EMBEDDED, default_engines)


def prompt(seed: int, length: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, vocab, length).astype(np.int64)


def assert_same_rows(a: dict[str, np.ndarray], b: dict[str, np.ndarray], window: int = 0) -> None:
    """Every hand-over row the decoder reads is the same: all positions' global-KV and index-key entries, and (with
    `window`, for a hit, whose cached positions before the last window carry zeros there) the window fields of the
    last `window` positions."""
    for key in (*HANDOVER_KEYS, "positions"):
        x, y = (a[key], b[key]) if not window or key not in HANDOVER_FIELDS else (a[key][-window:], b[key][-window:])
        assert a[key].shape == b[key].shape and x.dtype == y.dtype and np.array_equal(x, y), key


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
    assert_same_rows(hit.handover, reference.handover, engine.cfg.window_size)
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


def test_the_budget_evicts_the_least_recently_used_prefix_no_session_holds(engine) -> None:  # type: ignore[no-untyped-def]
    vocab = engine.cfg.vocab_size
    probe = EncoderService(engine, session_auth=False, prefix_cache_bytes=1 << 30)
    probe.encode_turn("p", prompt(5, 260, vocab), start=True)
    one = probe.prefix_cache.total_bytes()
    service = EncoderService(engine, session_auth=False, prefix_cache_bytes=int(one * 1.5))  # room for one entry
    a, b = prompt(6, 260, vocab), prompt(7, 260, vocab)
    service.encode_turn("a", a, start=True)
    service.encode_turn("b", b, start=True)  # the one entry is session a's base: pinned, so b's is not stored
    assert service.counters.get(k.PREFIX_EVICTIONS) == 0 and service.prefix_cache.pinned() == 1
    service.end("a")
    service.end("b")
    assert service.prefix_cache.pinned() == 0
    service.encode_turn("b", b, start=True)  # a miss again; a's entry, free now, makes room for b's
    assert service.counters.get(k.PREFIX_EVICTIONS) == 1 and len(service.prefix_cache) == 1
    assert service.prefix_cache.total_bytes() <= service.prefix_cache.budget_bytes
    service.end("b")
    service.encode_turn("b2", b, start=True)
    service.end("b2")
    service.encode_turn("a2", a, start=True)  # a was evicted: a miss
    service.end("a2")
    assert service.counters.get(k.PREFIX_HITS) == 1 and service.counters.get(k.PREFIX_MISSES) == 4
    service.encode_turn("c", prompt(9, 260, vocab), start=True, cache_salt="tenant")  # evicts a shared entry
    assert service.counters.get(k.PREFIX_EVICTIONS, k.PREFIX_SHARED) == 3  # counted where the evicted entry lived
    assert service.counters.get(k.PREFIX_EVICTIONS, k.PREFIX_SALTED) == 0


def test_idle_sessions_rest_on_their_cached_prefix_and_wake_exact(default_engines: Path, tmp_path: Path) -> None:
    """Eight sessions open with one document: between turns each holds only its own entries (the document's are the
    cache entry's, pinned), so their state bytes are a fraction of the same sessions' without the cache, and with
    the entry counted too still well below; a second turn wakes each whole and answers as the cold pipeline does."""
    params = SamplingParams(max_tokens=6)
    runs, held = {}, {}
    layout = open_engine("onnx", EMBEDDED, default_engines).layout
    for cache in (256 << 20, 0):
        root = tmp_path / f"registry{cache}"
        ensure_registry(root, EMBEDDED)
        pipe = InProcessPipeline(EMBEDDED, root, backend="onnx", engine_dir=default_engines, prefix_cache_bytes=cache)
        first = [pipe.chat(f"r{i}", DOCUMENT + f"\nWhat is at line {i}?", adapter=ADAPTERS[i % 4], new_session=True,
                           params=params).token_ids for i in range(8)]
        held[cache] = (pipe.encoder.sessions.total_bytes(), pipe.encoder.prefix_cache.total_bytes())
        if cache:
            assert pipe.encoder.prefix_cache.pinned() == 1 and len(pipe.encoder.prefix_cache) == 1
            assert all(isinstance(pipe.encoder.sessions.get(f"r{i}"), RestingRow) for i in range(8))
        second = [pipe.chat(f"r{i}", "And the next line?", adapter=ADAPTERS[(i + 1) % 4], params=params).token_ids
                  for i in range(8)]
        # the encoder state after two turns (woken whole where it rests), for a bit-for-bit comparison: a small
        # model's few greedy tokens can survive a wrong state
        rows = [pipe.encoder.sessions.get(f"r{i}") for i in range(8)]
        runs[cache] = (first, second, [wake(r, layout) if isinstance(r, RestingRow) else r for r in rows])
        for i in range(8):
            pipe.end(f"r{i}")
        assert pipe.encoder.prefix_cache.pinned() == 0
    assert runs[256 << 20][:2] == runs[0][:2]
    for cached_row, cold_row in zip(runs[256 << 20][2], runs[0][2]):
        assert_same_state(cached_row, cold_row, layout)
    (sessions, entry), (alone, _) = held[256 << 20], held[0]
    assert sessions < 0.35 * alone and sessions + entry < 0.6 * alone, held  # the document's entries held once


def test_a_rolled_back_turn_leaves_the_cache_whole(engine) -> None:  # type: ignore[no-untyped-def]
    ids = prompt(8, 300, engine.cfg.vocab_size)
    service = EncoderService(engine, session_auth=False, prefix_cache_bytes=256 << 20)
    reference = service.encode_turn("first", ids, start=True)
    service.rollback("first")  # the decoder refused the turn: the session is gone, the cached prefix stays valid
    assert not service.sessions.contains("first") and len(service.prefix_cache) == 1
    again = service.encode_turn("second", ids, start=True)
    assert service.counters.get(k.PREFIX_HITS) == 1
    assert_same_rows(again.handover, reference.handover, engine.cfg.window_size)


def test_two_sessions_hit_and_extend_one_prefix_at_once(engine) -> None:  # type: ignore[no-untyped-def]
    """Two sessions start from one cached prefix and prefill their own rests chunk by chunk, interleaved (as a server
    runs them between decode steps): each ends with the bits of its cold prefill, and the shared entry is unchanged
    (a third session still hits it with the same bits)."""
    vocab = engine.cfg.vocab_size
    shared = prompt(10, 512, vocab)
    texts = {s: np.concatenate([shared, prompt(11 + i, 300 + 40 * i, vocab)]) for i, s in enumerate(("x", "y"))}
    service = EncoderService(engine, session_auth=False, prefix_cache_bytes=256 << 20)
    service.encode_turn("seed", np.concatenate([shared, prompt(13, 20, vocab)]), start=True)
    turns = {s: service.begin_turn(s, ids, start=True) for s, ids in texts.items()}
    assert service.counters.get(k.PREFIX_HITS) == 2 and all(t.cached == 512 for t in turns.values())
    done: dict[str, bool] = {s: False for s in turns}
    while not all(done.values()):
        for s, turn in turns.items():
            if not done[s]:
                done[s] = service.advance_turn(turn)
    encoded = {s: service.finish_turn(t) for s, t in turns.items()}
    cold = EncoderService(engine, session_auth=False)
    for s, ids in texts.items():
        reference = cold.encode_turn(s, ids, start=True)
        assert_same_rows(encoded[s].handover, reference.handover, engine.cfg.window_size)
        assert encoded[s].h19.tobytes() == reference.h19.tobytes()
        assert_same_state(service.sessions.get(s), cold.sessions.get(s), engine.layout)
    third = service.encode_turn("z", texts["x"], start=True)
    assert_same_rows(third.handover, encoded["x"].handover, engine.cfg.window_size)


def test_steps_between_a_prefills_chunks_change_no_bit(engine) -> None:  # type: ignore[no-untyped-def]
    """A long prefill runs chunk by chunk while another session takes decode steps in between: both end with the
    bits they have alone, and the prefilling session is in flight (a second turn of it is refused) until it hands
    over."""
    vocab = engine.cfg.vocab_size
    long, short = prompt(20, 900, vocab), prompt(21, 30, vocab)
    steps = [np.asarray([[t]], np.int64) for t in prompt(22, 6, vocab)]
    mixed, alone = (EncoderService(engine, session_auth=False) for _ in range(2))
    mixed.encode_turn("talker", short, start=True)
    turn = mixed.begin_turn("reader", long, start=True)
    outs = []
    while not mixed.advance_turn(turn):
        outs.append(mixed.encode_step(["talker"], steps[len(outs)]))
        with pytest.raises(BadRequest, match="still answering"):
            mixed.begin_turn("reader", short, start=True)
    assert len(outs) == 3  # 900 tokens: four chunks, three steps between them
    encoded = mixed.finish_turn(turn)
    alone.encode_turn("talker", short, start=True)
    for step, out in zip(steps, outs):
        assert_same_rows({**out[0]}, {**alone.encode_step(["talker"], step)[0]})
    reference = alone.encode_turn("reader", long, start=True)
    assert_same_rows(encoded.handover, reference.handover)
    assert_same_state(mixed.sessions.get("reader"), alone.sessions.get("reader"), engine.layout)


def test_a_session_ended_while_its_turn_is_encoded_stores_nothing(engine) -> None:  # type: ignore[no-untyped-def]
    service = EncoderService(engine, session_auth=False)
    turn = service.begin_turn("gone", prompt(23, 600, engine.cfg.vocab_size), start=True)
    service.advance_turn(turn)
    service.end("gone")
    with pytest.raises(UnknownSession, match="ended while its turn was being encoded"):
        service.advance_turn(turn)
    service.abandon_turn(turn)
    assert not service.sessions.contains("gone")
    service.encode_turn("gone", prompt(24, 10, engine.cfg.vocab_size), start=True)  # the id is free again


def test_a_prefix_cache_block_must_hold_a_token() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        PrefixCache(0, 1 << 20)


def metric(server, name: str, partition: str) -> float:  # type: ignore[no-untyped-def]
    for line in urllib.request.urlopen(server.metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith(name + "{") and f'partition="{partition}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{partition={partition}}} is not exported")


@pytest.fixture(scope="module")
def server(shared_server):  # type: ignore[no-untyped-def]
    """The served tests' tritonserver (the cache and chunked prefill are on by default): the 4096-token one, shared
    with the session-token module (conftest.py)."""
    return shared_server(max_context="4096")


@pytest.fixture(scope="module")
def cold(tmp_path_factory, default_engines: Path) -> InProcessPipeline:
    """The reference: the serving library in process, without a prefix cache."""
    root = tmp_path_factory.mktemp("registry-cold")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, backend="onnx", engine_dir=default_engines, max_context=4096)


@pytest.mark.slow
def test_served_sessions_share_a_prefix_and_answer_as_cold(server, cold) -> None:  # type: ignore[no-untyped-def]
    """Through a real tritonserver: sessions that open with one document under different adapters hit the cache and
    answer with the tokens of a cold in-process prefill; a session with another cache_salt does not hit (the
    counters, not the timing, show it); a malformed salt is refused by name."""
    hits = metric(server, "mol2_prefix_cache_hits", "shared")
    chat = GrpcChat(server.grpc_url)
    try:
        chat.turn(TurnRequest("warm", DOCUMENT + "\nWhat does it do?", new_session=True, max_tokens=4))
        replies = {a: chat.turn(TurnRequest(f"s-{a}", DOCUMENT + f"\nExplain line 2 ({a}).", new_session=True,
                                            adapter=a, max_tokens=10)) for a in ADAPTERS}
        stranger = chat.turn(TurnRequest("stranger", DOCUMENT + "\nWhat does it do?", new_session=True,
                                         max_tokens=4, cache_salt="someone-else"))
        bad = chat.turn(TurnRequest("bad", "hi", new_session=True, max_tokens=2, cache_salt="x" * 300))
    finally:
        chat.close()
    assert metric(server, "mol2_prefix_cache_hits", "shared") == hits + len(ADAPTERS)
    assert metric(server, "mol2_prefix_cache_hits", "salted") == 0
    assert metric(server, "mol2_prefix_cache_misses", "salted") == 1
    assert not stranger.error and "cache_salt" in (bad.error or "")
    for adapter, reply in replies.items():
        assert not reply.error, reply.error
        expected = cold.chat(f"s-{adapter}", DOCUMENT + f"\nExplain line 2 ({adapter}).", adapter=adapter,
                             new_session=True, params=SamplingParams(max_tokens=10))
        assert reply.token_ids == expected.token_ids, adapter


@pytest.mark.slow
def test_32_concurrent_sessions_that_hit_answer_as_alone(server, cold) -> None:  # type: ignore[no-untyped-def]
    """32 sessions open at once with the cached document and their own questions (round robin over the adapters):
    every one hits and streams the tokens it gets alone, cold, in process."""
    chat = GrpcChat(server.grpc_url)
    try:
        chat.turn(TurnRequest("warm-32", DOCUMENT + "\nWhat does it do?", new_session=True, max_tokens=2))
    finally:
        chat.close()
    hits = metric(server, "mol2_prefix_cache_hits", "shared")
    requests = [TurnRequest(f"many-{i}", DOCUMENT + f"\nWhat is listed at line {i}?", new_session=True,
                            adapter=ADAPTERS[i % len(ADAPTERS)], max_tokens=5, end_session=True) for i in range(32)]
    got, errors = concurrent_token_ids(server.grpc_url, [[r] for r in requests])
    assert not errors, errors[:3]
    assert metric(server, "mol2_prefix_cache_hits", "shared") == hits + 32
    for r, replies in zip(requests, got):
        alone = cold.chat(r.session_id, r.text, r.adapter, new_session=True, params=SamplingParams(max_tokens=5))
        assert replies == [alone.token_ids], r.session_id


@pytest.mark.slow
def test_streams_go_on_while_a_long_prompt_is_prefilled(server) -> None:  # type: ignore[no-untyped-def]
    """Two sessions stream while a third sends a prompt of about 3,500 tokens: their tokens keep arriving between the
    long prompt's request and its first token (the prefill runs a piece at a time between decode steps; run whole,
    as before, no step could run until it ended). Counted in tokens, not timed."""
    long_prompt = " ".join(f"row {i} holds {i * 37 % 101} crates" for i in range(420))
    arrivals: list[list[float]] = [[], []]
    started = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        chat = GrpcChat(server.grpc_url)
        try:
            def on_piece(_: str) -> None:
                arrivals[i].append(time.perf_counter())
                if len(arrivals[i]) == 8:
                    started[i].set()
            chat.turn(TurnRequest(f"streamer-{i}", f"Count to {50 + i}.", new_session=True, max_tokens=600,
                                  ignore_eos=True, speculative=False, end_session=True), on_piece=on_piece)
        finally:
            started[i].set()
            chat.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)
    chat = GrpcChat(server.grpc_url)
    try:
        first: list[float] = []
        sent = time.perf_counter()
        reply = chat.turn(TurnRequest("long", long_prompt + "\nWhich row holds the most?", new_session=True,
                                      max_tokens=2, end_session=True),
                          on_piece=lambda _: first.append(time.perf_counter()) if not first else None)
    finally:
        chat.close()
    for t in threads:
        t.join(300)
    assert not reply.error and first, reply.error
    during = [sum(sent < a < first[0] for a in times) for times in arrivals]
    assert len(arrivals[0]) == len(arrivals[1]) == 600
    assert all(n >= 10 for n in during), during
