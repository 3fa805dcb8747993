"""Turn leases, pins when taken, and one commit per turn (issue 63), in process on the embedded default's engines:
a turn nobody continues gives its slot back, a cache entry a turn holds is never evicted from under it, and a failure
between the decoder's store and the encoder's commit leaves both sides at the same turn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import EMBEDDED
from tests.tritonserver_backend.in_process import onnx_pipeline
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.decoder_service import DecoderService
from tritonserver_backend.core.encoder_service import EncoderService
from tritonserver_backend.core.resting_rows import RestingRow
from tritonserver_backend.core.session_journal import MAX_SESSION_ID_BYTES, SessionJournal
from tritonserver_backend.core.turn_lease import CLAIMED, DEFAULT_LEASE_S, HANDED_OVER
from tritonserver_backend.engines import open_engine
from tritonserver_backend.errors import BadRequest, ServerBusy, TurnFailed, TurnNotDurable, UnknownSession
from tritonserver_backend.sampling.sampler import SamplingParams

GREEDY = SamplingParams(max_tokens=12)


class Clock:
    """The leases' clock, moved by the test (no test waits on the wall clock)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine(default_engines: Path):  # type: ignore[no-untyped-def]
    return open_engine("onnx", EMBEDDED, default_engines)


def prompt(seed: int, length: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, vocab, length).astype(np.int64)


def leased_service(engine, clock: Clock, **kwargs) -> EncoderService:  # type: ignore[no-untyped-def]
    service = EncoderService(engine, session_auth=False, lease_s=DEFAULT_LEASE_S, **kwargs)
    service.leases.clock = clock
    return service


def test_an_unclaimed_turn_gives_its_slot_back_when_its_lease_ends(engine) -> None:  # type: ignore[no-untyped-def]
    """Turns handed over and never continued fill the slots; the next turn is told to retry after the soonest
    expiry; once the lease has passed, the abandoned turns are rolled back (their sessions never started) and the
    next turn is admitted. A decoder arriving late with an expired turn is refused and changes nothing."""
    clock, vocab = Clock(), engine.cfg.vocab_size
    service = leased_service(engine, clock, max_turns=3)
    stale = [service.encode_turn(f"ghost-{i}", prompt(i, 20, vocab), start=True) for i in range(3)]
    assert [service.leases.get(f"ghost-{i}").status for i in range(3)] == [HANDED_OVER] * 3
    clock.now += DEFAULT_LEASE_S / 2
    with pytest.raises(ServerBusy, match=r"3 turns in flight \(limit 3\); retry after 15 s") as busy:
        service.encode_turn("user", prompt(9, 20, vocab), start=True)
    assert busy.value.retry_after_s == pytest.approx(DEFAULT_LEASE_S / 2)
    clock.now += DEFAULT_LEASE_S / 2
    encoded = service.encode_turn("user", prompt(9, 20, vocab), start=True)
    assert service.counters.get(k.TURN_LEASES_ENDED, k.LEASE_EXPIRED) == 3
    assert len(service.leases) == 1 and not any(service.sessions.contains(f"ghost-{i}") for i in range(3))
    with pytest.raises(UnknownSession, match="ghost-0' was rolled back: its first turn was not taken by a decoder"):
        service.claim("ghost-0", stale[0].turn_id)
    with pytest.raises((BadRequest, UnknownSession)):
        service.encode_step(["ghost-0"], np.asarray([[7]]), turn_ids=np.asarray([stale[0].turn_id]))
    assert not service.rollback("ghost-0", stale[0].turn_id)  # nothing of it is left to undo
    service.claim("user", encoded.turn_id)
    assert service.leases.get("user").status == CLAIMED


def test_a_claimed_turn_never_expires_and_a_commit_ends_its_lease(engine) -> None:  # type: ignore[no-untyped-def]
    clock, vocab = Clock(), engine.cfg.vocab_size
    service = leased_service(engine, clock, max_turns=1)
    encoded = service.encode_turn("queued", prompt(1, 30, vocab), start=True)
    service.claim("queued", encoded.turn_id)
    clock.now += 10 * DEFAULT_LEASE_S  # waiting for a row behind a busy batch
    assert service.expire_leases() == 0
    ids = np.asarray([encoded.turn_id])
    service.encode_step(["queued"], np.asarray([[11]]), turn_ids=ids)
    service.encode_step(["queued"], np.zeros((1, 0), np.int64), turn_done=True, turn_ids=ids)  # the commit
    assert len(service.leases) == 0 and service.sessions.get("queued").position == 31
    with pytest.raises(BadRequest, match="no turn in flight"):  # a step after the commit changes nothing
        service.encode_step(["queued"], np.asarray([[12]]), turn_ids=ids)
    assert service.sessions.get("queued").position == 31


def test_a_step_or_rollback_naming_another_turn_changes_nothing(engine) -> None:  # type: ignore[no-untyped-def]
    """A decoder that still holds an old turn of a session (its lease ended, the session started again) can neither
    step nor roll back the session's new turn."""
    vocab = engine.cfg.vocab_size
    service = leased_service(engine, Clock())
    old = service.encode_turn("s", prompt(2, 25, vocab), start=True)
    assert service.rollback("s", old.turn_id)
    new = service.encode_turn("s", prompt(3, 40, vocab), start=True)
    position = service.sessions.get("s").position
    with pytest.raises(BadRequest, match=f"turn {old.turn_id} is no longer in flight"):
        service.encode_step(["s"], np.asarray([[5]]), turn_ids=np.asarray([old.turn_id]))
    assert not service.rollback("s", old.turn_id)
    assert service.sessions.get("s").position == position and service.leases.get("s").turn_id == new.turn_id


def test_evicting_a_session_ends_its_turns_lease(engine) -> None:  # type: ignore[no-untyped-def]
    vocab = engine.cfg.vocab_size
    probe = EncoderService(engine, session_auth=False)
    probe.encode_turn("x", prompt(4, 50, vocab), start=True)
    budget = int(probe.sessions.total_bytes() * 1.5)  # room for one such session, not two
    service = leased_service(engine, Clock(), max_turns=2, budget_bytes=budget)
    first = service.encode_turn("first", prompt(4, 50, vocab), start=True)
    service.encode_turn("second", prompt(5, 50, vocab), start=True)
    assert not service.sessions.contains("first") and service.leases.get("first") is None
    assert service.counters.get(k.TURN_LEASES_ENDED, k.LEASE_EVICTED) == 1
    with pytest.raises(UnknownSession, match="evicted"):
        service.encode_step(["first"], np.asarray([[5]]), turn_ids=np.asarray([first.turn_id]))
    service.encode_turn("third", prompt(6, 50, vocab), start=True)  # its slot is free again


def test_a_cache_entry_a_turn_took_is_pinned_until_its_turn_ends(engine) -> None:  # type: ignore[no-untyped-def]
    """The interleaving that leaked memory: a turn takes a cached prefix, other sessions' inserts fill the cache
    before it hands over. Pinned when taken, the entry stays; the session then rests on an entry the cache holds, so
    its bytes count in the cache's budget, and nothing is pinned once every turn has ended."""
    vocab = engine.cfg.vocab_size
    shared = prompt(7, 256, vocab)
    sizing = EncoderService(engine, session_auth=False, prefix_cache_bytes=1 << 30)
    sizing.encode_turn("m", np.concatenate([shared, prompt(8, 10, vocab)]), start=True)
    entry_bytes = sizing.prefix_cache.total_bytes()
    service = EncoderService(engine, session_auth=False, prefix_cache_bytes=int(entry_bytes * 1.5))
    service.encode_turn("seed", np.concatenate([shared, prompt(8, 10, vocab)]), start=True)
    service.rollback("seed")
    taker = service.begin_turn("taker", np.concatenate([shared, prompt(9, 10, vocab)]), start=True)
    assert taker.cached == 256
    for i in range(3):  # each would evict the least recently used unpinned entry
        service.encode_turn(f"other-{i}", np.concatenate([prompt(20 + i, 256, vocab), prompt(9, 5, vocab)]),
                            start=True)
        service.rollback(f"other-{i}")
    while not service.advance_turn(taker):
        pass
    encoded = service.finish_turn(taker)
    service.encode_step(["taker"], np.zeros((1, 0), np.int64), turn_done=True, turn_ids=np.asarray([encoded.turn_id]))
    resting = service.sessions.get("taker")
    assert isinstance(resting, RestingRow) and service.prefix_cache.holds(resting.base)
    assert resting.base.pins == 1  # the session's own pin; the turn's were given back
    service.end("taker")
    assert service.prefix_cache.pinned() == 0


def test_a_prefix_storm_stays_within_both_budgets(engine) -> None:  # type: ignore[no-untyped-def]
    """Sessions with distinct long prefixes under small budgets, each turn committed: every byte a session or the
    cache holds counts in one budget, the sum stays within both (plus one session: the store keeps the newest), every
    resting session's base is in the cache, and the evictions are counted."""
    vocab = engine.cfg.vocab_size
    session_budget, cache_budget = 6 << 20, 4 << 20
    service = EncoderService(engine, session_auth=False, budget_bytes=session_budget, prefix_cache_bytes=cache_budget)
    largest = 0
    for i in range(24):
        encoded = service.encode_turn(f"storm-{i}", prompt(100 + i, 1024 + 7, vocab), start=True)
        service.encode_step([f"storm-{i}"], np.zeros((1, 0), np.int64), turn_done=True,
                            turn_ids=np.asarray([encoded.turn_id]))
        largest = max(largest, max(v.nbytes() for v in service.sessions._items.values()))
        assert service.prefix_cache.total_bytes() <= cache_budget
        assert service.sessions.total_bytes() <= session_budget + largest
        for value in service.sessions._items.values():
            if isinstance(value, RestingRow):
                assert service.prefix_cache.holds(value.base)
    assert service.counters.get(k.PREFIX_EVICTIONS) > 0 and len(service.leases) == 0


def test_session_ids_are_bounded_in_length(engine) -> None:  # type: ignore[no-untyped-def]
    service = EncoderService(engine, session_auth=False)
    ids = prompt(1, 5, engine.cfg.vocab_size)
    service.encode_turn("é" * (MAX_SESSION_ID_BYTES // 2), ids, start=True)
    with pytest.raises(BadRequest, match=f"at most {MAX_SESSION_ID_BYTES}"):
        service.encode_turn("é" * (MAX_SESSION_ID_BYTES // 2) + "x", ids, start=True)


# ---------------------------------------------------------------------------------------------- one commit per turn
@pytest.fixture
def pipelines(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    return onnx_pipeline(tmp_path_factory, default_engines), onnx_pipeline(tmp_path_factory, default_engines)


TURNS = ("import os\nprint(os.listdir('.'))", "And the hidden files too?", "Sort them by size.")


def _conversation(pipeline, fail_at: int | None = None, resend: bool = True) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The three turns; at `fail_at` the turn fails once and (with `resend`) is sent again, as a client would."""
    replies = []
    for i, text in enumerate(TURNS):
        if i == fail_at:
            with pytest.raises((TurnFailed, RuntimeError), match="failed|lost"):
                pipeline.chat("c", text, adapter="L2_code", new_session=i == 0, params=GREEDY)
            if not resend:
                replies.append([])
                continue
        replies.append(pipeline.chat("c", text, adapter="L2_code", new_session=i == 0, params=GREEDY).token_ids)
    return replies


def test_a_decoder_store_that_fails_after_the_last_tokens_rolls_both_sides_back(pipelines, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The turn's last tokens reached the encoder, then the decoder's store failed: the encoder had not committed,
    so both sides go back to the previous turn, the client's resend is answered, and the conversation equals a
    never-failed one token for token."""
    failing, reference = pipelines
    real_finish = DecoderService.finish
    calls = {"n": 0}

    def finish_failing_once(self, turn, trailing):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("the decoder's store failed")
        return real_finish(self, turn, trailing)

    monkeypatch.setattr(DecoderService, "finish", finish_failing_once)
    got = _conversation(failing, fail_at=1)
    monkeypatch.setattr(DecoderService, "finish", real_finish)
    assert got == _conversation(reference)
    assert failing.encoder.sessions.get("c").position == failing.decoder.sessions.get("c").position


def test_a_commit_that_fails_rolls_the_decoder_back_too(pipelines, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The decoder stored its side, then the encoder's commit call failed before committing: the rollback finds the
    turn still open, so the decoder restores its previous state as well, and the resent turn continues as if the
    failure never happened."""
    failing, reference = pipelines
    real_step = EncoderService.encode_step
    commits = {"n": 0}

    def commit_failing_once(self, session_ids, tokens, turn_done=False, *args, **kwargs):  # type: ignore[no-untyped-def]
        if turn_done and np.asarray(tokens).shape[1] == 0:
            commits["n"] += 1
            if commits["n"] == 2:
                raise RuntimeError("the commit call was lost")
        return real_step(self, session_ids, tokens, turn_done, *args, **kwargs)

    monkeypatch.setattr(EncoderService, "encode_step", commit_failing_once)
    got = _conversation(failing, fail_at=1)
    monkeypatch.setattr(EncoderService, "encode_step", real_step)
    assert got == _conversation(reference)


def test_a_commit_whose_answer_is_lost_keeps_the_turn_on_both_sides(pipelines, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The encoder committed the turn, then its answer was lost: the rollback finds nothing open (False), so the
    decoder keeps its side too; both hold the turn, and the session's next turn equals a never-failed run's."""
    failing, reference = pipelines
    real_step = EncoderService.encode_step
    commits = {"n": 0}

    def commit_answer_lost_once(self, session_ids, tokens, turn_done=False, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = real_step(self, session_ids, tokens, turn_done, *args, **kwargs)
        if turn_done and np.asarray(tokens).shape[1] == 0:
            commits["n"] += 1
            if commits["n"] == 2:
                raise RuntimeError("the commit's answer was lost")
        return out

    monkeypatch.setattr(EncoderService, "encode_step", commit_answer_lost_once)
    got = _conversation(failing, fail_at=1, resend=False)
    monkeypatch.setattr(EncoderService, "encode_step", real_step)
    expected = _conversation(reference)
    assert got[0] == expected[0] and got[2] == expected[2]
    assert failing.encoder.sessions.get("c").position == failing.decoder.sessions.get("c").position


def test_a_failed_journal_write_is_told_and_never_resumed_stale(tmp_path, default_engines) -> None:  # type: ignore[no-untyped-def]
    """The journal's file is replaced by a folder (a write that fails for root too): the turn is answered and kept,
    its client is told it will not survive a restart, and a restarted server does not resume the older state."""
    from tritonserver_backend.adapters.registry_init import ensure_registry
    from tritonserver_backend.core.pipeline import InProcessPipeline
    from tritonserver_backend.core.session_journal import file_name

    ensure_registry(tmp_path / "registry", EMBEDDED)

    def pipeline() -> InProcessPipeline:
        return InProcessPipeline(EMBEDDED, tmp_path / "registry", backend="onnx", engine_dir=default_engines,
                                 session_dir=tmp_path / "sessions")

    first = pipeline()
    first.chat("j", TURNS[0], adapter="base", new_session=True, params=GREEDY)
    path = tmp_path / "sessions" / file_name("j")
    path.unlink()
    path.mkdir()
    with pytest.raises(TurnNotDurable, match="will not survive a restart; do not resend it"):
        first.chat("j", TURNS[1], adapter="base", params=GREEDY)
    position = first.encoder.sessions.get("j").position
    assert position == first.decoder.sessions.get("j").position  # kept on both sides
    first.chat("j", TURNS[2], adapter="base", params=GREEDY)  # the session goes on in memory
    path.rmdir()
    again = pipeline()
    with pytest.raises(UnknownSession):
        again.chat("j", TURNS[2], adapter="base", params=GREEDY)


def test_a_journal_of_another_model_or_vocabulary_is_refused_by_name(tmp_path, engine) -> None:  # type: ignore[no-untyped-def]
    vocab = engine.cfg.vocab_size
    SessionJournal(tmp_path, model_digest="model-a").commit("other-model", prompt(1, 8, vocab), None, reset=True)
    SessionJournal(tmp_path, model_digest="model-b").commit("wide", np.asarray([1, 2, vocab + 5]), None, reset=True)
    service = EncoderService(engine, session_auth=False,
                             journal=SessionJournal(tmp_path, model_digest="model-b", vocab_size=vocab))
    with pytest.raises(UnknownSession, match="cannot be resumed: its journal was written for another model"):
        service.encode_turn("other-model", prompt(2, 4, vocab))
    with pytest.raises(UnknownSession, match=r"cannot be resumed: its journal holds token ids outside"):
        service.encode_turn("wide", prompt(2, 4, vocab))
    # the encoder checks resumed ids like any input, whatever the journal checked
    unchecked = EncoderService(engine, session_auth=False, journal=SessionJournal(tmp_path, model_digest="model-b"))
    with pytest.raises(BadRequest, match="the journal's history holds ids outside"):
        unchecked.encode_turn("wide", prompt(2, 4, vocab))
