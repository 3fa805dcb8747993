"""Every live session's token history on disk, so that a process death (or a server restart) loses no conversation.

Why a journal, and why here: the encoder is the one role that sees every token of a conversation (a user turn's
prefill, then each generated token through the decoder's step calls) and that holds the session token's digest. The
decoder's state is rebuilt from the encoder's hand-over (its replay window and global-KV mirror follow from the
encoder's rows), each turn replays under its own adapter (routed afresh or named on the request) and each turn's
sampler is seeded by its own request, so a session's token ids and token digest are all its next turn needs.

One file per session (`<dir>/s-<hex of the id>.journal`, or `h-<sha256>.journal` for a long id), append-only:

* a `reset` record holds the whole history (a session that starts, restarts from sent history, or forks): the file is
  written beside and renamed over the old one;
* a `turn` record holds the tokens one completed turn added (its prompt, its reply, end-of-turn): appended at the
  turn's end, and fsync'd before the decoder's last step call returns, so before the client sees the final response.
  A turn in flight is never written: it is in the history whole or not at all.

The files hold every conversation's token ids, so the folder is 0700 and each file 0600 whatever the umask (an
existing folder or file this process owns is tightened at start). Removals and renames are followed by an fsync of
the folder, so a file a power loss brings back is never one the journal meant gone.

A record is a little-endian (payload length, CRC-32 of the payload) header and a JSON payload (session id, kind,
token digest, model digest, time, tokens as base64 int32). A file is read back at start (`SessionJournal(...)`):

* a last record cut short (a torn append: a crash in the middle of a write) is cut off, the file truncated back to
  its last complete record, and the session resumes from those (`RecoveryReport.torn`). Only the turn whose write
  never finished is lost, and that turn's client never got its final response (the fsync comes first);
* a record that fails its checksum, anywhere, is corruption: the session is refused by name (`refusal`) and loses
  only itself (`RecoveryReport.corrupt`);
* a session whose records were written for another model build (`model_digest`), or whose ids fall outside the
  vocabulary (`vocab_size`), is refused by name too (`mismatched`, `out_of_vocab`) and its file kept, so that an
  operator who swaps the engines back gets it back;
* sessions last written longer than `ttl_s` ago are dropped, and when the journals pass `budget_bytes` the least
  recently written sessions are dropped whole (never truncated), each named in the start-up report.

A write that fails ends that session's journal: its file is removed (emptied when it cannot be removed: an empty file
is refused at start), later turns are not written, `commit` answers False and `ended_reason` says why, so a restart
never resumes an older state of a conversation that went on. An ended or evicted session's file is removed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

HEADER = struct.Struct("<II")  # payload bytes, CRC-32 of the payload
SUFFIX = ".journal"
TMP_SUFFIX = SUFFIX + ".tmp"
MAX_RECORD_BYTES = 64 << 20  # a length past this is a corrupt header, not a record
MAX_SESSION_ID_BYTES = 256  # UTF-8 bytes: an id is a key the client picks, not a place to store data
DEFAULT_TTL_S = 7 * 24 * 3600.0
DEFAULT_BUDGET_BYTES = 1 << 30
RESET, TURN = "reset", "turn"
DIR_MODE, FILE_MODE = 0o700, 0o600
# A payload is JSON with ensure_ascii: every byte is printable ASCII. A record header's length is under 64 MiB, so its
# fourth byte is 0-3: never printable. This is what tells a torn tail from a corrupt length (read `scan_records`).
_PRINTABLE = bytes(range(0x20, 0x7F))
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a link planted at a journal's name is not followed out of the folder
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# the files that give a journal's token ids their meaning: the model's configuration (its vocabulary among it) and its
# tokenizer (a release directory keeps its own configuration under inference/)
MEANING_FILES = ("config.json", "inference/config.json", "tokenizer.json", "tokenizer_config.json")


def model_digest(model_dir: Path | str) -> str:
    """The digest a journal's records carry (`SessionJournal(model_digest=...)`): SHA-256 over the model's
    configuration and tokenizer files. Why those and not the engines: a journal holds token ids, and a resumed
    session is prefilled again from them, so what must not change is what the ids mean (the tokenizer and the model
    they index); an engine rebuilt from the same checkpoint (another format, a quantized build) resumes the same
    conversation, while another model or tokenizer would resume a different one and is refused by name."""
    h = hashlib.sha256(b"mol2-journal-model\0")
    root = Path(model_dir)
    for name in MEANING_FILES:
        path = root / name
        if path.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:32]


def check_session_id(session_id: str) -> None:
    """ValueError unless `session_id` fits MAX_SESSION_ID_BYTES: it is logged, named in reports and hashed into a
    file name on every turn, so an unbounded one would let a client make every one of those as large as it likes."""
    try:
        size = len(session_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError("session_id is not valid Unicode text (it holds a lone surrogate)") from None
    if size > MAX_SESSION_ID_BYTES:
        raise ValueError(f"session_id is {size} bytes; at most {MAX_SESSION_ID_BYTES}")


@dataclass
class JournalEntry:
    """A session as its journal holds it: its whole token history and its token digest (None: tokens off)."""

    tokens: np.ndarray  # int64 (positions,)
    digest: str | None
    written_at: float
    path: Path
    nbytes: int = 0


@dataclass
class RecoveryReport:
    """What the start-up read found: sessions kept, and those dropped or refused, by name and why."""

    kept: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    over_budget: list[str] = field(default_factory=list)
    corrupt: dict[str, str] = field(default_factory=dict)  # session id (or file name when unreadable) -> why
    torn: dict[str, str] = field(default_factory=dict)  # kept, its torn last write cut off: session id -> what was cut
    mismatched: dict[str, str] = field(default_factory=dict)  # written for another model build: session id -> why
    out_of_vocab: dict[str, str] = field(default_factory=dict)  # ids outside the vocabulary: session id -> why

    @property
    def refused(self) -> dict[str, str]:
        """Every session refused at start, whatever the kind, with its reason (what the server log should name)."""
        return {**self.corrupt, **self.mismatched, **self.out_of_vocab}

    def summary(self) -> str:
        parts = [f"{len(self.kept)} sessions resumable"]
        if self.torn:
            parts.append(f"{len(self.torn)} resumed without a torn last write ({_names(list(self.torn))})")
        if self.expired:
            parts.append(f"{len(self.expired)} expired and dropped ({_names(self.expired)})")
        if self.over_budget:
            parts.append(f"{len(self.over_budget)} dropped over the journal budget ({_names(self.over_budget)})")
        if self.corrupt:
            parts.append(f"{len(self.corrupt)} refused as corrupt ({_names(list(self.corrupt))})")
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} refused as written for another model or engine build "
                         f"({_names(list(self.mismatched))}; their files are kept)")
        if self.out_of_vocab:
            parts.append(f"{len(self.out_of_vocab)} refused for token ids outside the vocabulary "
                         f"({_names(list(self.out_of_vocab))})")
        return "; ".join(parts)


def _names(ids: list[str], shown: int = 8) -> str:
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return ", ".join(repr(s) for s in ids[:shown]) + more


class JournalCorrupt(ValueError):
    """A journal file whose records do not read back whole."""


def file_name(session_id: str) -> str:
    raw = session_id.encode("utf-8")
    if len(raw) <= 100:
        return f"s-{raw.hex()}{SUFFIX}"
    return f"h-{hashlib.sha256(raw).hexdigest()}{SUFFIX}"


def session_of(name: str) -> str | None:
    """The session id a file name spells (None for a hashed name: only its records say)."""
    if name.startswith("s-") and name.endswith(SUFFIX):
        try:
            return bytes.fromhex(name[2:-len(SUFFIX)]).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None
    return None


def encode_record(session_id: str, kind: str, tokens: np.ndarray, digest: str | None, at: float,
                  model: str = "") -> bytes:
    """One record. `model`: the model digest the ids belong to. The payload is ASCII JSON (ensure_ascii), which the
    torn-tail test in `scan_records` relies on."""
    payload = json.dumps({"session": session_id, "kind": kind, "digest": digest, "model": model, "at": at,
                          "tokens": base64.b64encode(np.asarray(tokens, "<i4").tobytes()).decode("ascii")},
                         separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return HEADER.pack(len(payload), binascii.crc32(payload)) + payload


@dataclass
class Scan:
    """A file's complete records, the bytes they fill, and what its torn tail held (None: the file is whole)."""

    records: list[dict]
    whole_bytes: int
    torn: str | None


def _payload_prefix(partial: bytes) -> bool:
    """Could `partial` be the start of a payload whose write never finished? Every payload byte is printable ASCII
    and a header never is, so bytes with no header among them are the one record's; and a strict prefix of a JSON
    object is never a whole JSON document, so a whole one means the length, not the write, is wrong."""
    if partial.translate(None, _PRINTABLE):
        return False
    try:
        json.loads(partial)
    except ValueError:
        return True
    return False


def scan_records(data: bytes) -> Scan:
    """Every complete record of a file, checked, and the torn tail after them when the last write never finished.

    Why a torn tail is not corruption: an append is the last thing written to a file, and a crash in the middle of it
    leaves a record shorter than its header says, at the end. The records before it were each fsync'd whole, so
    they are the session's history up to its last completed turn. A checksum that fails, or a length that runs past
    the end over another record's bytes, is damage no crash leaves: JournalCorrupt names the record."""
    records: list[dict] = []
    offset, index = 0, 0
    while offset < len(data):
        index += 1
        left = len(data) - offset
        if left < HEADER.size:
            return Scan(records, offset, f"record {index} is cut short ({left} of its {HEADER.size} header bytes)")
        length, crc = HEADER.unpack_from(data, offset)
        if length > MAX_RECORD_BYTES:
            raise JournalCorrupt(f"record {index}'s length is corrupt ({length} bytes)")
        start = offset + HEADER.size
        if start + length > len(data):
            partial = data[start:]
            if not _payload_prefix(partial):
                raise JournalCorrupt(f"record {index}'s length ({length} bytes) is corrupt: it runs past the end of "
                                     "the file over bytes that are not its own")
            return Scan(records, offset, f"record {index} is cut short ({len(partial)} of its {length} payload bytes)")
        payload = data[start:start + length]
        if binascii.crc32(payload) != crc:
            raise JournalCorrupt(f"record {index} fails its checksum")
        try:
            record = json.loads(payload)
            record["tokens"] = np.frombuffer(base64.b64decode(record["tokens"]), "<i4").astype(np.int64)
        except (ValueError, KeyError, TypeError) as exc:
            raise JournalCorrupt(f"record {index} does not parse ({exc})") from None
        records.append(record)
        offset = start + length
    return Scan(records, offset, None)


def read_records(data: bytes) -> list[dict]:
    """Every record of a file, all whole: JournalCorrupt names the first one that is not (a torn tail included; the
    start-up read, which may cut one off, uses `scan_records`)."""
    scan = scan_records(data)
    if scan.torn is not None:
        raise JournalCorrupt(scan.torn)
    if not scan.records:
        raise JournalCorrupt("the file holds no record")
    return scan.records


@dataclass
class Replayed:
    """A journal file read back: its session, its entry (from its complete records) and what the checks need."""

    session: str
    entry: JournalEntry
    models: set[str]  # the model digests its records carry ("" for a record written without one)
    torn: str | None  # what its torn tail held (None: the file is whole)


def replay_file(path: Path) -> Replayed:
    """A journal file -> its session and entry. JournalCorrupt when a record is damaged or they disagree."""
    data = path.read_bytes()
    if not data:  # a journal file is never written empty (a start is renamed in whole): a failed write emptied it
        raise JournalCorrupt("it is empty: a write that failed ended it, so it no longer holds the conversation")
    scan = scan_records(data)
    if not scan.records:
        raise JournalCorrupt(f"it holds no complete record ({scan.torn})")
    records = scan.records
    session = records[0].get("session")
    named = session_of(path.name)
    if not isinstance(session, str) or (named is not None and session != named):
        raise JournalCorrupt(f"its records name session {session!r}, its file name {named!r}")
    if records[0].get("kind") != RESET:
        raise JournalCorrupt("its first record is not the session's start")
    pieces: list[np.ndarray] = []
    digest, at = None, 0.0
    models: set[str] = set()
    for record in records:
        if record.get("session") != session or record.get("kind") not in (RESET, TURN):
            raise JournalCorrupt(f"a record names {record.get('session')!r} / kind {record.get('kind')!r}")
        if record["kind"] == RESET:
            pieces = []
        pieces.append(record["tokens"])
        digest, at = record.get("digest"), float(record.get("at", 0.0))
        model = record.get("model")
        models.add(model if isinstance(model, str) else "")
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    return Replayed(session, JournalEntry(tokens, digest, at, path, scan.whole_bytes), models, scan.torn)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (a full disk, a file size limit): go on until all is written or it fails."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(f"the write made no progress ({written} bytes)")
        view = view[written:]


def _private_dir(directory: Path) -> None:
    """Make the journal folder 0700 (and tighten one this process owns): every conversation's ids are inside."""
    directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    st = directory.stat()
    if stat.S_IMODE(st.st_mode) & 0o077:
        if st.st_uid != os.geteuid():
            log.warning("session journal: folder %s is mode %o and owned by uid %d, not this process: it is left "
                        "as it is; make it 0700", directory, stat.S_IMODE(st.st_mode), st.st_uid)
            return
        try:
            os.chmod(directory, DIR_MODE)
        except OSError as exc:
            log.warning("session journal: could not make folder %s 0700 (%s)", directory, exc)


def _tighten_file(path: Path) -> None:
    """A journal file written before files were 0600 (or under another umask): make it 0600 if this process owns it."""
    try:
        st = path.lstat()
        if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != FILE_MODE and st.st_uid == os.geteuid():
            os.chmod(path, FILE_MODE)
    except OSError as exc:
        log.warning("session journal: could not make %s 0600 (%s)", path, exc)


def _open_private(path: Path, flags: int) -> int:
    """A descriptor on a journal file, which is 0600 whatever the umask or the mode an older version left."""
    fd = os.open(path, flags | _CLOEXEC | _NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SessionJournal:
    """The journal directory of one server: every journaled session's history in memory, its file on disk.

    Thread-safe (one lock): the Triton encoder writes from its worker thread, a test may read from another."""

    def __init__(self, directory: Path | str, ttl_s: float = DEFAULT_TTL_S,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES, now: float | None = None, model_digest: str = "",
                 vocab_size: int | None = None) -> None:
        """`model_digest`: what identifies the model, engines and tokenizer the ids belong to (the caller computes
        it); written in every record, and a journal written under another digest is refused at start (ids are only
        a conversation under the tokenizer and engines that wrote them). "" turns the check off. `vocab_size`: a
        resumed session's ids must lie in [0, vocab_size) (None: unchecked)."""
        self.directory = Path(directory)
        _private_dir(self.directory)
        self.ttl_s, self.budget_bytes = ttl_s, budget_bytes
        self.model_digest, self.vocab_size = model_digest, vocab_size
        self._entries: dict[str, JournalEntry] = {}
        self._refused: dict[str, str] = {}  # session id -> why it cannot be resumed (phrased "its journal ...")
        self._ended: dict[str, str] = {}  # session id -> why its journal no longer follows it (for its client)
        self._lock = threading.Lock()
        self.write_failures = 0
        self.report = self._recover(time.time() if now is None else now)

    # ------------------------------------------------------------------ start-up
    def _recover(self, now: float) -> RecoveryReport:
        report = RecoveryReport()
        removed = False
        for path in sorted(self.directory.glob(f"*{TMP_SUFFIX}")):  # a rename that never happened: the old file holds
            try:
                path.unlink(missing_ok=True)
                removed = True
            except OSError as exc:
                log.warning("session journal: could not remove the unfinished %s (%s)", path, exc)
        found: list[Replayed] = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            _tighten_file(path)
            try:
                found.append(replay_file(path))
            except (JournalCorrupt, OSError) as exc:
                self._refuse(report.corrupt, session_of(path.name) or path.name,
                             f"its journal {path} is corrupt: {exc}")
        kept: list[Replayed] = []
        for item in found:
            if now - item.entry.written_at > self.ttl_s:
                report.expired.append(item.session)
                removed |= self._unlink_quietly(item.entry.path)
                continue
            why = self._mismatch(item)
            if why is not None:
                self._refuse(report.mismatched, item.session, why)
                continue
            why = self._out_of_vocab(item)
            if why is not None:
                self._refuse(report.out_of_vocab, item.session, why)
                continue
            why = self._oversized_id(item)
            if why is not None:
                self._refuse(report.corrupt, item.session, why)
                continue
            kept.append(item)
        kept.sort(key=lambda item: item.entry.written_at, reverse=True)  # the newest first: the oldest go over budget
        total = 0
        for item in kept:
            total += item.entry.nbytes
            if total > self.budget_bytes:
                report.over_budget.append(item.session)
                removed |= self._unlink_quietly(item.entry.path)
                continue
            if item.torn is not None:
                try:
                    self._cut_torn_tail(item.entry)
                except OSError as exc:
                    total -= item.entry.nbytes
                    self._refuse(report.corrupt, item.session, f"its journal {item.entry.path} ends in a torn write "
                                 f"({item.torn}) that could not be cut off ({exc})")
                    continue
                report.torn[item.session] = item.torn
                log.warning("session journal: session %r's last write was torn (%s): cut back to its last complete "
                            "record, the turn that write held is lost", item.session, item.torn)
            self._entries[item.session] = item.entry
            report.kept.append(item.session)
        if removed:
            self._sync_dir_quietly()
        return report

    def _refuse(self, into: dict[str, str], session: str, why: str) -> None:
        into[session] = why
        self._refused[session] = why
        log.warning("session journal: session %r cannot be resumed: %s", session, why)

    def _mismatch(self, item: Replayed) -> str | None:
        """A journal written under another model digest: refused, since the same ids under another tokenizer or
        engine build are another conversation. A record without a digest counts as another build when this journal
        has one (ids tied to no build are not trusted); with no digest here, nothing is checked."""
        if not self.model_digest:
            return None
        others = sorted(m for m in item.models if m != self.model_digest)
        if not others:
            return None
        theirs = ", ".join(repr(m) if m else "none" for m in others)
        return (f"its journal was written for another model or engine build (digest {theirs}, this server "
                f"{self.model_digest!r})")

    def _out_of_vocab(self, item: Replayed) -> str | None:
        tokens = item.entry.tokens
        if self.vocab_size is None or tokens.size == 0:
            return None
        low, high = int(tokens.min()), int(tokens.max())
        if low >= 0 and high < self.vocab_size:
            return None
        bad = low if low < 0 else high
        return f"its journal holds token ids outside the vocabulary [0, {self.vocab_size}) (e.g. {bad})"

    @staticmethod
    def _oversized_id(item: Replayed) -> str | None:
        try:
            check_session_id(item.session)
        except ValueError as exc:
            return f"its journal names an id no request may carry ({exc})"
        return None

    @staticmethod
    def _cut_torn_tail(entry: JournalEntry) -> None:
        """Truncate a file back to its last complete record, durably: the next append must follow a whole record,
        or the torn bytes would sit in the middle of the file and make it corrupt."""
        fd = _open_private(entry.path, os.O_WRONLY)
        try:
            os.ftruncate(fd, entry.nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ reads
    def history(self, session_id: str) -> JournalEntry | None:
        with self._lock:
            return self._entries.get(session_id)

    def refusal(self, session_id: str) -> str | None:
        """Why a session cannot be resumed, or None: its journal was corrupt at start, written for another model
        build, holds ids outside the vocabulary, or a write failed and ended it."""
        with self._lock:
            return self._refused.get(session_id)

    def ended_reason(self, session_id: str) -> str | None:
        """Why the journal no longer follows a live session (a write failed, it was dropped over the budget, its
        start was never journaled), phrased for its client; None while it does, or for a session it never held.
        Set when `commit` answers False; cleared when the session starts again (a reset commit) or is dropped."""
        with self._lock:
            return self._ended.get(session_id)

    def sessions(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    # ------------------------------------------------------------------ writes
    def commit(self, session_id: str, tokens: np.ndarray, digest: str | None, reset: bool) -> bool:
        """A completed turn: `tokens` it added (reset: the whole history). Durable (fsync'd) when this returns True.

        False when the session's journal has ended: a write failed now or before (its file is then removed, or
        emptied, so a restart does not resume an older state of the conversation), it was dropped over the budget,
        or its start is not journaled. The session goes on in memory but would not survive a restart;
        `ended_reason(session_id)` says why. A reset (the session starts again) tries afresh.
        ValueError for an id longer than MAX_SESSION_ID_BYTES (nothing is written)."""
        check_session_id(session_id)
        tokens = np.asarray(tokens, np.int64)
        now = time.time()
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None and not reset:  # its start is not on disk (dropped over budget, a failed write): a
                self._ended.setdefault(  # record of this turn alone would resume a different conversation
                    session_id, "the session's start is not in the journal: it will not survive a restart")
                return False
            path = entry.path if entry is not None else self.directory / file_name(session_id)
            try:
                if reset or entry is None:
                    entry = self._rewrite(session_id, tokens, digest, now)
                else:
                    self._append(entry, session_id, tokens, digest, now)
            except OSError as exc:
                self._end_journal(session_id, path, exc)
                return False
            self._refused.pop(session_id, None)
            self._ended.pop(session_id, None)
            self._entries[session_id] = entry
            self._enforce_budget(keep=session_id)
            return True

    def _end_journal(self, session_id: str, path: Path, exc: OSError) -> None:
        """A write failed: end the session's journal so that no restart resumes it. Its file may hold an older
        state, or a torn record the start-up read would cut off: either way resuming it would answer a conversation
        that is not the one the client had, and every later turn would be missing. So the file goes (or, when it
        cannot be removed, is emptied, which the start-up read refuses); the session is refused for the rest of
        this process too."""
        self.write_failures += 1
        self._entries.pop(session_id, None)
        left = self._remove_file(path)
        self._ended[session_id] = f"the session's journal could not be written ({exc}): it will not survive a restart"
        self._refused[session_id] = f"its journal could not be written ({exc}) and was ended"
        log.error("session journal: could not write session %r (%s); its journal ended and it will not survive a "
                  "restart%s", session_id, exc, left)

    def _remove_file(self, path: Path) -> str:
        """Remove a session's file, else empty it; the folder is fsync'd after a removal. Returns what is left, for
        the log ("" when the file is gone)."""
        try:
            path.unlink(missing_ok=True)
        except OSError as unlinked:
            try:
                fd = _open_private(path, os.O_WRONLY)
                try:
                    os.ftruncate(fd, 0)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as emptied:
                return (f"; its file {path} could be neither removed ({unlinked}) nor emptied ({emptied}): remove it "
                        "before the next start, or that start may resume an older state of the conversation")
            return f"; its file {path} could not be removed ({unlinked}) and was emptied (refused at the next start)"
        self._sync_dir_quietly()
        return ""

    def _rewrite(self, session_id: str, tokens: np.ndarray, digest: str | None, now: float) -> JournalEntry:
        path = self.directory / file_name(session_id)
        tmp = path.with_name(path.name + ".tmp")
        data = encode_record(session_id, RESET, tokens, digest, now, self.model_digest)
        fd = _open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)  # a half-written start is nobody's
            except OSError:
                pass
            raise
        _fsync_dir(self.directory)
        return JournalEntry(tokens.copy(), digest, now, path, len(data))

    def _append(self, entry: JournalEntry, session_id: str, tokens: np.ndarray, digest: str | None,
                now: float) -> None:
        """Append a turn. No O_CREAT: a file that vanished must fail the write, not be started again from a turn
        record without its session's start (which the start-up read would refuse anyway)."""
        data = encode_record(session_id, TURN, tokens, digest, now, self.model_digest)
        fd = _open_private(entry.path, os.O_WRONLY | os.O_APPEND)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        entry.tokens = np.concatenate([entry.tokens, tokens])
        entry.digest, entry.written_at, entry.nbytes = digest, now, entry.nbytes + len(data)

    def _enforce_budget(self, keep: str) -> None:
        """Over budget: drop the least recently written sessions' journals whole (they stay live in memory but
        would not survive a restart), each logged by name."""
        total = sum(e.nbytes for e in self._entries.values())
        removed = False
        for session, entry in sorted(self._entries.items(), key=lambda item: item[1].written_at):
            if total <= self.budget_bytes:
                break
            if session == keep:
                continue
            total -= entry.nbytes
            removed |= self._unlink_quietly(entry.path)
            del self._entries[session]
            self._ended[session] = (f"the session's journal was dropped over the journal's {self.budget_bytes}-byte "
                                    "budget: it will not survive a restart")
            log.warning("session journal over its %d-byte budget: dropped session %r's journal (it is still live "
                        "but would not survive a restart)", self.budget_bytes, session)
        if removed:
            self._sync_dir_quietly()

    def drop(self, session_id: str) -> None:
        """The session ended or was evicted: its journal goes (emptied when it cannot be removed, so that no
        restart resumes a conversation that ended)."""
        with self._lock:
            entry = self._entries.pop(session_id, None)
            self._refused.pop(session_id, None)
            self._ended.pop(session_id, None)
            path = entry.path if entry is not None else self.directory / file_name(session_id)
            if not (path.exists() or path.is_symlink()):
                return
            left = self._remove_file(path)
            if left:
                self._refused[session_id] = "its journal could not be removed when it ended"
                log.error("session journal: session %r ended%s", session_id, left)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _unlink_quietly(path: Path) -> bool:
        """Remove a file the policy drops (expired, over budget); True when something was removed (the caller then
        fsyncs the folder once). A failure is logged: the file is read again at the next start."""
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("session journal: could not remove %s (%s)", path, exc)
            return False

    def _sync_dir_quietly(self) -> None:
        """fsync the folder after removals: without it a power loss can bring a removed file back. A failure here
        is logged, not raised: the removal happened, only its durability is in doubt."""
        try:
            _fsync_dir(self.directory)
        except OSError as exc:
            log.warning("session journal: could not fsync folder %s after a removal (%s)", self.directory, exc)
