"""The session journal: its file format and start-up policy, and sessions resumed from it by a fresh pipeline (what
a server restart, or a model process that died, leaves) answering exactly as the never-stopped pipeline does."""

from __future__ import annotations

import base64
import binascii
import json
import os
import shutil
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import EMBEDDED
from tritonserver_backend.auth.session_auth import SessionRefused
from tritonserver_backend.core.session_journal import (
    HEADER,
    MAX_SESSION_ID_BYTES,
    SessionJournal,
    check_session_id,
    file_name,
    read_records,
)
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


def _bounds(data: bytes) -> list[tuple[int, int]]:
    """Each record's (start, end) in a journal file's bytes."""
    out, offset = [], 0
    while offset < len(data):
        length, _ = HEADER.unpack_from(data, offset)
        out.append((offset, offset + HEADER.size + length))
        offset += HEADER.size + length
    return out


@pytest.mark.parametrize("damage", ["flip-last", "flip-middle", "length-past-the-end"])
def test_a_damaged_record_loses_only_its_session(tmp_path, damage: str) -> None:  # type: ignore[no-untyped-def]
    """A checksum that fails (in the last record or in the middle) or a length that runs over the next record is
    damage no crash leaves: the session is refused by name, whatever its place in the file, and the others go on."""
    journal = SessionJournal(tmp_path)
    for name in ("good", "bad", "long-" + "x" * 120):
        journal.commit(name, np.arange(10), "d", reset=True)
        journal.commit(name, np.arange(5), "d", reset=False)
        journal.commit(name, np.arange(3), "d", reset=False)
    path = tmp_path / file_name("bad")
    data = bytearray(path.read_bytes())
    bounds = _bounds(bytes(data))
    if damage == "flip-last":
        data[-3] ^= 0xFF  # inside the last record's payload: its checksum no longer holds, its length does
    elif damage == "flip-middle":
        data[bounds[1][0] + HEADER.size + 5] ^= 0xFF  # the second of three records
    else:  # the second record's length now runs past the end of the file, over the third record's header
        HEADER.pack_into(data, bounds[1][0], len(data), HEADER.unpack_from(data, bounds[1][0])[1])
    path.write_bytes(bytes(data))
    reopened = SessionJournal(tmp_path)
    assert sorted(reopened.sessions()) == sorted(["good", "long-" + "x" * 120])
    assert "bad" in reopened.report.corrupt and "bad" in reopened.report.summary() and not reopened.report.torn
    why = reopened.refusal("bad")
    assert why is not None and ("checksum" in why if damage.startswith("flip") else "length" in why), why
    assert reopened.history("bad") is None and path.read_bytes() == bytes(data), "a refused file is left as it is"
    assert reopened.commit("bad", np.arange(3), "d2", reset=True)  # starting it again clears the refusal
    assert reopened.refusal("bad") is None and SessionJournal(tmp_path).history("bad") is not None


@pytest.mark.parametrize("cut", ["in-the-payload", "after-the-header", "in-the-header"])
def test_a_torn_last_write_keeps_every_complete_record(tmp_path, cut: str) -> None:  # type: ignore[no-untyped-def]
    """A last record shorter than its header says (or a header cut short) is a write a crash tore: the session resumes
    from the complete records before it, the file is cut back to them (so the next append follows a whole record),
    and the start-up report names it."""
    journal = SessionJournal(tmp_path)
    journal.commit("a", np.array([1, 2, 3]), "d", reset=True)
    journal.commit("a", np.array([4, 5]), "d", reset=False)
    journal.commit("a", np.array([6, 7, 8]), "d", reset=False)
    journal.commit("other", np.array([9]), "d", reset=True)
    path = tmp_path / file_name("a")
    data = path.read_bytes()
    last = _bounds(data)[-1][0]
    keep = {"in-the-payload": HEADER.size + 20, "after-the-header": HEADER.size, "in-the-header": 3}[cut]
    path.write_bytes(data[:last + keep])
    reopened = SessionJournal(tmp_path)
    entry = reopened.history("a")
    assert entry is not None and entry.tokens.tolist() == [1, 2, 3, 4, 5] and entry.digest == "d"
    assert "a" in reopened.report.torn and "cut short" in reopened.report.torn["a"] and not reopened.report.corrupt
    assert "torn" in reopened.report.summary() and reopened.refusal("a") is None
    assert path.read_bytes() == data[:last] and entry.nbytes == last, "the file is cut back to its last whole record"
    assert [r["kind"] for r in read_records(path.read_bytes())] == ["reset", "turn"]
    assert reopened.commit("a", np.array([10]), "d", reset=False)
    again = SessionJournal(tmp_path)
    assert again.history("a").tokens.tolist() == [1, 2, 3, 4, 5, 10] and not again.report.torn  # type: ignore[union-attr]
    assert again.history("other").tokens.tolist() == [9]  # type: ignore[union-attr]


def test_a_file_with_no_complete_record_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A start is renamed in whole, so a file whose only record is cut short is not a torn append: refused."""
    SessionJournal(tmp_path).commit("a", np.arange(4), "d", reset=True)
    path = tmp_path / file_name("a")
    path.write_bytes(path.read_bytes()[:-5])
    reopened = SessionJournal(tmp_path)
    assert reopened.history("a") is None and "no complete record" in (reopened.refusal("a") or "")


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


def test_a_session_dropped_over_the_budget_says_why_its_journal_ended(tmp_path) -> None:  # type: ignore[no-untyped-def]
    journal = SessionJournal(tmp_path)
    journal.commit("old", np.arange(100), "d", reset=True)
    journal.budget_bytes = (tmp_path / file_name("old")).stat().st_size
    assert journal.commit("new", np.arange(100), "d", reset=True)
    assert journal.sessions() == ["new"] and not (tmp_path / file_name("old")).exists()
    assert not journal.commit("old", np.arange(3), "d", reset=False), "a turn without its session's start"
    assert "budget" in (journal.ended_reason("old") or "") and journal.ended_reason("new") is None


# ------------------------------------------------------------------------------------- private files
def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_folder_0700_and_files_0600_whatever_the_umask(tmp_path, umask: int) -> None:  # type: ignore[no-untyped-def]
    """Every conversation's token ids are in these files: no umask (a permissive one included) opens them up."""
    folder = tmp_path / "deep" / "sessions"
    old = os.umask(umask)
    try:
        journal = SessionJournal(folder)
        journal.commit("a", np.arange(5), "d", reset=True)
        started = _mode(folder / file_name("a"))
        journal.commit("a", np.arange(3), "d", reset=False)
        journal.commit("b", np.arange(3), "d", reset=True)
    finally:
        os.umask(old)
    assert _mode(folder) == 0o700
    assert started == 0o600 and _mode(folder / file_name("a")) == 0o600 and _mode(folder / file_name("b")) == 0o600
    assert sorted(p.name for p in folder.iterdir()) == sorted([file_name("a"), file_name("b")]), "no .tmp is left"


def test_an_open_folder_and_files_from_before_are_tightened(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A folder and files an older version left 0755 / 0644 (this process owns them): tightened at start, and a file
    an append opens is made 0600 too."""
    folder = tmp_path / "sessions"
    folder.mkdir()
    os.chmod(folder, 0o755)
    SessionJournal(folder).commit("a", np.arange(5), "d", reset=True)
    os.chmod(folder, 0o755)
    os.chmod(folder / file_name("a"), 0o644)
    reopened = SessionJournal(folder)
    assert _mode(folder) == 0o700 and _mode(folder / file_name("a")) == 0o600
    os.chmod(folder / file_name("a"), 0o644)
    assert reopened.commit("a", np.arange(2), "d", reset=False)
    assert _mode(folder / file_name("a")) == 0o600


# ------------------------------------------------------------------------------------- a write that fails
def _file_size_limit(limit: int):  # type: ignore[no-untyped-def]
    """RLIMIT_FSIZE: a write past `limit` bytes of any file fails (EFBIG, after a short write), for root too; Python
    ignores SIGXFSZ, so the write returns the error instead of killing the process. A full disk, reproducibly."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    class Limit:
        def __enter__(self) -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))

        def __exit__(self, *exc: object) -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    return Limit()


def test_a_failed_append_ends_the_journal_and_no_restart_resumes_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An append the disk refuses half-way (a torn record, as a full disk leaves): without ending the journal, the
    next start would cut the torn record off and resume the conversation as it was two turns ago, every later turn
    gone. So the file is removed, commit answers False with a reason, and neither this journal nor a new one on the
    folder resumes the session; starting it again journals it afresh."""
    journal = SessionJournal(tmp_path)
    journal.commit("a", np.arange(10), "d", reset=True)
    journal.commit("b", np.arange(10), "d", reset=True)
    path = tmp_path / file_name("a")
    with _file_size_limit(path.stat().st_size + 10):
        assert not journal.commit("a", np.arange(50), "d", reset=False)
    reason = journal.ended_reason("a")
    assert reason is not None and "could not be written" in reason and "restart" in reason, reason
    assert "could not be written" in (journal.refusal("a") or "") and journal.write_failures == 1
    assert not path.exists() and journal.history("a") is None
    assert not journal.commit("a", np.arange(3), "d", reset=False), "later turns are not journaled"
    assert journal.ended_reason("a") == reason, "the first reason is kept"
    reopened = SessionJournal(tmp_path)
    assert reopened.history("a") is None and reopened.sessions() == ["b"]
    assert journal.commit("a", np.arange(4), "d2", reset=True), "starting it again journals it afresh"
    assert journal.ended_reason("a") is None and journal.refusal("a") is None
    assert SessionJournal(tmp_path).history("a").tokens.tolist() == [0, 1, 2, 3]  # type: ignore[union-attr]


def test_a_failed_start_removes_the_older_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A reset (the session starts over) that cannot be written leaves the older conversation on disk unless it is
    removed: it is, and the unfinished .tmp a start-up finds (here a folder nobody can remove as a file) stops
    nothing."""
    journal = SessionJournal(tmp_path)
    journal.commit("a", np.arange(10), "d", reset=True)
    journal.commit("a", np.arange(5), "d", reset=False)
    path = tmp_path / file_name("a")
    blocker = path.with_name(path.name + ".tmp")
    blocker.mkdir()  # os.open(O_CREAT | O_WRONLY) on it fails with EISDIR, for root too
    assert not journal.commit("a", np.arange(3), "d", reset=True)
    assert not path.exists() and "could not be written" in (journal.ended_reason("a") or "")
    reopened = SessionJournal(tmp_path)
    assert reopened.history("a") is None and reopened.sessions() == []
    blocker.rmdir()
    assert reopened.commit("a", np.arange(3), "d", reset=True)
    assert SessionJournal(tmp_path).history("a").tokens.tolist() == [0, 1, 2]  # type: ignore[union-attr]


def test_a_file_that_cannot_be_removed_is_never_resumed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The write fails and so does the removal (a folder stands at the file's name: EISDIR for both, root too): the
    session is refused in this process and, at the next start, by name."""
    journal = SessionJournal(tmp_path)
    journal.commit("a", np.arange(10), "d", reset=True)
    path = tmp_path / file_name("a")
    path.unlink()
    path.mkdir()
    assert not journal.commit("a", np.arange(5), "d", reset=False)
    assert journal.history("a") is None and journal.refusal("a") is not None and journal.ended_reason("a")
    reopened = SessionJournal(tmp_path)
    assert reopened.history("a") is None and "a" in reopened.report.corrupt and reopened.refusal("a") is not None
    journal.drop("a")  # an end cannot remove it either: refused, never resumed
    assert journal.refusal("a") is not None and journal.history("a") is None


def test_an_emptied_file_is_refused_at_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What a failed write leaves when its file cannot be removed but can be emptied: no start resumes it."""
    journal = SessionJournal(tmp_path)
    journal.commit("a", np.arange(10), "d", reset=True)
    (tmp_path / file_name("a")).write_bytes(b"")
    reopened = SessionJournal(tmp_path)
    assert reopened.history("a") is None and "empty" in (reopened.refusal("a") or "")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes through a read-only mode; the root-proof failures are tested above")
def test_a_read_only_file_ends_the_journal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    journal = SessionJournal(tmp_path)
    journal.commit("a", np.arange(10), "d", reset=True)
    path = tmp_path / file_name("a")
    os.chmod(path, 0o400)
    assert not journal.commit("a", np.arange(5), "d", reset=False)
    assert not path.exists() and SessionJournal(tmp_path).history("a") is None


# ------------------------------------------------------------------------------------- what a resumed journal must be
def _legacy_file(folder: Path, session: str, tokens: list[int]) -> None:
    """A journal file as written before records carried a model digest (no "model" key)."""
    payload = json.dumps({"session": session, "kind": "reset", "digest": "d", "at": time.time(),
                          "tokens": base64.b64encode(np.asarray(tokens, "<i4").tobytes()).decode("ascii")}).encode()
    (folder / file_name(session)).write_bytes(HEADER.pack(len(payload), binascii.crc32(payload)) + payload)


def test_a_journal_of_another_model_build_is_refused_by_name_and_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    journal = SessionJournal(tmp_path, model_digest="build-A")
    journal.commit("a", np.arange(10), "d", reset=True)
    journal.commit("a", np.arange(5), "d", reset=False)
    path = tmp_path / file_name("a")
    assert {r["model"] for r in read_records(path.read_bytes())} == {"build-A"}, "every record names its build"
    other = SessionJournal(tmp_path, model_digest="build-B")
    why = other.refusal("a")
    assert other.history("a") is None and why is not None
    assert "another model or engine build" in why and "'build-A'" in why and "'build-B'" in why, why
    assert other.report.mismatched == {"a": why} and other.report.refused == {"a": why}
    assert "another model" in other.report.summary() and path.exists(), "the file is kept for a swap back"
    assert not other.commit("a", np.arange(3), "d", reset=False)
    back = SessionJournal(tmp_path, model_digest="build-A")
    assert back.history("a").tokens.tolist() == list(range(10)) + list(range(5))  # type: ignore[union-attr]
    assert SessionJournal(tmp_path).history("a") is not None, "no digest here: nothing to check"


def test_records_with_no_model_digest_are_not_trusted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _legacy_file(tmp_path, "old", [1, 2, 3])
    SessionJournal(tmp_path).commit("unnamed", np.arange(3), "d", reset=True)  # written with model ""
    assert sorted(SessionJournal(tmp_path).sessions()) == ["old", "unnamed"]
    strict = SessionJournal(tmp_path, model_digest="build-A")
    assert strict.sessions() == [] and sorted(strict.report.mismatched) == ["old", "unnamed"]
    assert "digest none" in (strict.refusal("old") or "")


def test_ids_outside_the_vocabulary_are_refused_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    journal = SessionJournal(tmp_path)
    journal.commit("in", np.array([0, 7, 49]), "d", reset=True)
    journal.commit("over", np.array([0, 50]), "d", reset=True)
    journal.commit("negative", np.array([3, -1]), "d", reset=True)
    checked = SessionJournal(tmp_path, vocab_size=50)
    assert checked.sessions() == ["in"] and sorted(checked.report.out_of_vocab) == ["negative", "over"]
    why = checked.refusal("over")
    assert why is not None and "outside the vocabulary [0, 50)" in why and "vocabulary" in checked.report.summary()
    assert (tmp_path / file_name("over")).exists()
    assert sorted(SessionJournal(tmp_path, vocab_size=51).sessions()) == ["in", "over"]


def test_session_ids_are_bounded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    check_session_id("x" * MAX_SESSION_ID_BYTES)
    check_session_id("é" * (MAX_SESSION_ID_BYTES // 2))
    with pytest.raises(ValueError, match=f"session_id is 257 bytes; at most {MAX_SESSION_ID_BYTES}"):
        check_session_id("x" * 257)
    with pytest.raises(ValueError, match="is 258 bytes"):  # UTF-8 bytes, not characters
        check_session_id("é" * 129)
    with pytest.raises(ValueError, match="not valid Unicode"):
        check_session_id("a\udc80")
    journal = SessionJournal(tmp_path)
    with pytest.raises(ValueError, match="at most 256"):
        journal.commit("x" * 257, np.arange(3), "d", reset=True)
    assert list(tmp_path.iterdir()) == [] and journal.sessions() == []


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
