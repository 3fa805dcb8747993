"""The session journal: its file format and start-up policy, and sessions resumed from it by a fresh pipeline (what
a server restart, or a model process that died, leaves) answering exactly as the never-stopped pipeline does."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

from tests.conftest import EMBEDDED
from tritonserver_backend.auth.session_auth import SessionRefused
from tritonserver_backend.core.session_journal import SessionJournal, file_name, read_records
from tritonserver_backend.errors import UnknownSession
from tritonserver_backend.sampling.sampler import SamplingParams


# ------------------------------------------------------------------------------------- the file and its policy
def test_turns_append_and_a_reset_rewrites(tmp_path) -> None:  # type: ignore[no-untyped-def]
    journal = SessionJournal(tmp_path)
    journal.commit("a", np.array([1, 2, 3]), "d1", reset=True)
    journal.commit("a", np.array([4, 5]), "d1", reset=False)
    path = tmp_path / file_name("a")
    assert [r["kind"] for r in read_records(path.read_bytes())] == ["reset", "turn"]
    reopened = SessionJournal(tmp_path)
    entry = reopened.history("a")
    assert entry is not None and entry.tokens.tolist() == [1, 2, 3, 4, 5] and entry.digest == "d1"
    reopened.commit("a", np.array([9]), "d2", reset=True)  # a restart: the file holds the new start only
    assert [r["kind"] for r in read_records(path.read_bytes())] == ["reset"]
    assert SessionJournal(tmp_path).history("a").tokens.tolist() == [9]  # type: ignore[union-attr]
    reopened.drop("a")
    assert not path.exists() and SessionJournal(tmp_path).sessions() == []
    assert not reopened.commit("a", np.array([7]), "d2", reset=False), "a turn without its session's start"
    assert not path.exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_record_loses_only_its_session(tmp_path, damage: str) -> None:  # type: ignore[no-untyped-def]
    journal = SessionJournal(tmp_path)
    for name in ("good", "bad", "long-" + "x" * 120):
        journal.commit(name, np.arange(10), "d", reset=True)
        journal.commit(name, np.arange(5), "d", reset=False)
    path = tmp_path / file_name("bad")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0xFF  # inside the last record's payload: its checksum no longer holds
    else:
        del data[-4:]  # cut short, as a write that never finished leaves it
    path.write_bytes(bytes(data))
    reopened = SessionJournal(tmp_path)
    assert sorted(reopened.sessions()) == sorted(["good", "long-" + "x" * 120])
    assert "bad" in reopened.report.corrupt and "bad" in reopened.report.summary()
    why = reopened.refusal("bad")
    assert why is not None and ("checksum" in why or "cut short" in why)
    reopened.commit("bad", np.arange(3), "d2", reset=True)  # starting it again clears the refusal
    assert reopened.refusal("bad") is None and SessionJournal(tmp_path).history("bad") is not None


def test_expired_and_over_budget_sessions_are_dropped_whole_and_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    journal = SessionJournal(tmp_path)
    for i in range(4):
        journal.commit(f"s{i}", np.arange(100), "d", reset=True)
        time.sleep(0.01)
    later = time.time() + 3600
    expired = SessionJournal(tmp_path, ttl_s=60, now=later)
    assert sorted(expired.report.expired) == ["s0", "s1", "s2", "s3"] and expired.sessions() == []
    assert not list(tmp_path.glob("*.journal"))
    for i in range(4):
        journal.commit(f"t{i}", np.arange(100), "d", reset=True)
        time.sleep(0.01)
    newest_two = sum((tmp_path / file_name(f"t{i}")).stat().st_size for i in (2, 3))
    bounded = SessionJournal(tmp_path, budget_bytes=newest_two)
    assert sorted(bounded.sessions()) == ["t2", "t3"], "the most recently written sessions are kept"
    assert sorted(bounded.report.over_budget) == ["t0", "t1"]
    kept = bounded.history("t3")
    assert kept is not None and kept.tokens.tolist() == list(range(100)), "a kept session is never truncated"


# ------------------------------------------------------------------------------------- resumed on the default
@pytest.fixture(scope="module")
def registry_root(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tritonserver_backend.adapters.registry_init import ensure_registry

    root = tmp_path_factory.mktemp("registry")
    ensure_registry(root, EMBEDDED)
    return root


def _pipeline(registry_root, session_dir):  # type: ignore[no-untyped-def]
    from tritonserver_backend.core.pipeline import InProcessPipeline

    return InProcessPipeline(EMBEDDED, registry_root, session_auth=True, session_dir=session_dir)


def test_a_resumed_session_answers_as_the_never_stopped_one(registry_root, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two turns, a crash (the journal copied as it is on disk), then the next turn on a fresh pipeline from the copy:
    the same token ids (greedy, routed) as the pipeline that never stopped, under the session token issued at the
    start; the turn in flight at the crash is not in the journal; a wrong token is refused."""
    live_dir, crashed_dir = tmp_path / "live", tmp_path / "crashed"
    live = _pipeline(registry_root, live_dir)
    params = SamplingParams(max_tokens=10)
    token = live.chat("s", "Tell me about ships.", new_session=True, params=params).session_token
    live.chat("s", "How do I center a div?", params=params, session_token=token)
    before = (live_dir / file_name("s")).read_bytes()
    in_flight = live.encoder.begin_turn("s", np.array(live.text.render("half done", False, None)[0]),
                                        session_token=token)
    live.encoder.advance_turn(in_flight)
    assert (live_dir / file_name("s")).read_bytes() == before, "a turn in flight reached the journal"
    live.encoder.abandon_turn(in_flight)
    shutil.copytree(live_dir, crashed_dir)
    expected = live.chat("s", "And the sea?", params=params, session_token=token)
    assert expected.token_ids

    resumed = _pipeline(registry_root, crashed_dir)
    with pytest.raises(SessionRefused):
        resumed.chat("s", "And the sea?", params=params, session_token="not-the-token")
    with pytest.raises(SessionRefused):  # nor can a stranger take the journaled id over by starting it again
        resumed.chat("s", "Mine now.", new_session=True, params=params)
    got = resumed.chat("s", "And the sea?", params=params, session_token=token)
    assert got.token_ids == expected.token_ids and got.adapter == expected.adapter
    assert got.session_token == "", "a resumed session keeps its token: none is issued"
    positions = [(p.encoder.sessions.get("s").position, p.decoder.sessions.get("s").position)
                 for p in (live, resumed)]
    assert positions[0] == positions[1], positions
    again = _pipeline(registry_root, crashed_dir)  # the resumed turn was journaled too: a second crash keeps it
    assert again.journal.history("s").tokens.tolist() == live.journal.history("s").tokens.tolist()  # type: ignore[union-attr]
    again.encoder.check_token("s", token, "cancel")  # a cancel or end before its next turn is its owner's
    with pytest.raises(SessionRefused):
        again.encoder.check_token("s", "not-the-token", "cancel")
    again.end("s")
    assert again.journal.history("s") is None and not (crashed_dir / file_name("s")).exists()


def test_ended_sessions_leave_the_journal_and_corrupt_ones_are_refused(registry_root, tmp_path) -> None:  # type: ignore[no-untyped-def]
    first = _pipeline(registry_root, tmp_path)
    params = SamplingParams(max_tokens=4)
    tokens = {s: first.chat(s, "Hello there.", new_session=True, params=params).session_token
              for s in ("ended", "broken", "fine")}
    first.end("ended")
    path = tmp_path / file_name("broken")
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 2] ^= 0xFF
    path.write_bytes(bytes(data))
    second = _pipeline(registry_root, tmp_path)
    with pytest.raises(SessionRefused):  # ended: nothing to resume, and a stranger's view of it is the refusal
        second.chat("ended", "Hi again.", params=params, session_token=tokens["ended"])
    with pytest.raises(UnknownSession, match="'broken' cannot be resumed: .*corrupt"):
        second.chat("broken", "Hi again.", params=params, session_token=tokens["broken"])
    assert second.chat("fine", "Hi again.", params=params, session_token=tokens["fine"]).token_ids
    restarted = second.chat("broken", "Start over.", new_session=True, params=params)
    assert restarted.session_token, "a corrupt session can be started again under its id"


HEADER_BYTES = 8


def test_a_resumed_fork_holds_its_source_history(registry_root, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A fork's journal starts with its source's history: resumed, it answers as the never-stopped fork does."""
    live_dir, crashed_dir = tmp_path / "live", tmp_path / "crashed"
    live = _pipeline(registry_root, live_dir)
    params = SamplingParams(max_tokens=8)
    token = live.chat("src", "Tell me about ships.", new_session=True, params=params).session_token
    fork_token = live.chat("fork", "And boats?", new_session=True, params=params, fork_from="src",
                           fork_token=token).session_token
    assert fork_token
    shutil.copytree(live_dir, crashed_dir)
    expected = live.chat("fork", "Which is faster?", params=params, session_token=fork_token)
    got = _pipeline(registry_root, crashed_dir).chat("fork", "Which is faster?", params=params,
                                                      session_token=fork_token)
    assert got.token_ids == expected.token_ids and expected.token_ids
