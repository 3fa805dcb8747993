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

A record is a little-endian (payload length, CRC-32 of the payload) header and a JSON payload (session id, kind,
token digest, time, tokens as base64 int32). A file is read back at start (`SessionJournal(...)`): a session whose
record fails its checksum or is cut short is refused by name (`refusal`) and loses only itself; sessions last written
longer than `ttl_s` ago are dropped, and when the journals pass `budget_bytes` the least recently written sessions are
dropped whole (never truncated), each named in the start-up report. An ended or evicted session's file is removed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

HEADER = struct.Struct("<II")  # payload bytes, CRC-32 of the payload
SUFFIX = ".journal"
MAX_RECORD_BYTES = 64 << 20  # a length past this is a corrupt header, not a record
DEFAULT_TTL_S = 7 * 24 * 3600.0
DEFAULT_BUDGET_BYTES = 1 << 30
RESET, TURN = "reset", "turn"


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

    def summary(self) -> str:
        parts = [f"{len(self.kept)} sessions resumable"]
        if self.expired:
            parts.append(f"{len(self.expired)} expired and dropped ({_names(self.expired)})")
        if self.over_budget:
            parts.append(f"{len(self.over_budget)} dropped over the journal budget ({_names(self.over_budget)})")
        if self.corrupt:
            parts.append(f"{len(self.corrupt)} refused as corrupt ({_names(list(self.corrupt))})")
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


def encode_record(session_id: str, kind: str, tokens: np.ndarray, digest: str | None, at: float) -> bytes:
    payload = json.dumps({"session": session_id, "kind": kind, "digest": digest, "at": at,
                          "tokens": base64.b64encode(np.asarray(tokens, "<i4").tobytes()).decode("ascii")},
                         separators=(",", ":")).encode("utf-8")
    return HEADER.pack(len(payload), binascii.crc32(payload)) + payload


def read_records(data: bytes) -> list[dict]:
    """Every record of a file, checked; JournalCorrupt names the first one that is not whole."""
    records, offset, index = [], 0, 0
    while offset < len(data):
        index += 1
        if len(data) - offset < HEADER.size:
            raise JournalCorrupt(f"record {index} is cut short ({len(data) - offset} header bytes)")
        length, crc = HEADER.unpack_from(data, offset)
        offset += HEADER.size
        if length > MAX_RECORD_BYTES or offset + length > len(data):
            raise JournalCorrupt(f"record {index} is cut short or its length is corrupt ({length} bytes)")
        payload = data[offset:offset + length]
        offset += length
        if binascii.crc32(payload) != crc:
            raise JournalCorrupt(f"record {index} fails its checksum")
        try:
            record = json.loads(payload)
            record["tokens"] = np.frombuffer(base64.b64decode(record["tokens"]), "<i4").astype(np.int64)
        except (ValueError, KeyError, TypeError) as exc:
            raise JournalCorrupt(f"record {index} does not parse ({exc})") from None
        records.append(record)
    if not records:
        raise JournalCorrupt("the file holds no record")
    return records


def replay_file(path: Path) -> tuple[str, JournalEntry]:
    """A journal file -> (session id, its entry). JournalCorrupt when a record is not whole or they disagree."""
    records = read_records(path.read_bytes())
    session = records[0].get("session")
    named = session_of(path.name)
    if not isinstance(session, str) or (named is not None and session != named):
        raise JournalCorrupt(f"its records name session {session!r}, its file name {named!r}")
    if records[0].get("kind") != RESET:
        raise JournalCorrupt("its first record is not the session's start")
    pieces: list[np.ndarray] = []
    digest, at = None, 0.0
    for record in records:
        if record.get("session") != session or record.get("kind") not in (RESET, TURN):
            raise JournalCorrupt(f"a record names {record.get('session')!r} / kind {record.get('kind')!r}")
        if record["kind"] == RESET:
            pieces = []
        pieces.append(record["tokens"])
        digest, at = record.get("digest"), float(record.get("at", 0.0))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    return session, JournalEntry(tokens, digest, at, path, path.stat().st_size)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SessionJournal:
    """The journal directory of one server: every journaled session's history in memory, its file on disk.

    Thread-safe (one lock): the Triton encoder writes from its worker thread, a test may read from another."""

    def __init__(self, directory: Path | str, ttl_s: float = DEFAULT_TTL_S,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES, now: float | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ttl_s, self.budget_bytes = ttl_s, budget_bytes
        self._entries: dict[str, JournalEntry] = {}
        self._corrupt: dict[str, str] = {}
        self._lock = threading.Lock()
        self.write_failures = 0
        self.report = self._recover(time.time() if now is None else now)

    # ------------------------------------------------------------------ start-up
    def _recover(self, now: float) -> RecoveryReport:
        report = RecoveryReport()
        for path in sorted(self.directory.glob(f"*{SUFFIX}.tmp")):  # a rename that never happened: the old file holds
            path.unlink(missing_ok=True)
        found: list[tuple[str, JournalEntry]] = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            try:
                found.append(replay_file(path))
            except (JournalCorrupt, OSError) as exc:
                name = session_of(path.name) or path.name
                why = f"its journal {path} is corrupt: {exc}"
                report.corrupt[name] = why
                self._corrupt[name] = why
        kept: list[tuple[str, JournalEntry]] = []
        for session, entry in found:
            if now - entry.written_at > self.ttl_s:
                report.expired.append(session)
                entry.path.unlink(missing_ok=True)
            else:
                kept.append((session, entry))
        kept.sort(key=lambda item: item[1].written_at, reverse=True)  # the newest first: the oldest go over budget
        total = 0
        for session, entry in kept:
            total += entry.nbytes
            if total > self.budget_bytes:
                report.over_budget.append(session)
                entry.path.unlink(missing_ok=True)
            else:
                self._entries[session] = entry
                report.kept.append(session)
        return report

    # ------------------------------------------------------------------ reads
    def history(self, session_id: str) -> JournalEntry | None:
        with self._lock:
            return self._entries.get(session_id)

    def refusal(self, session_id: str) -> str | None:
        """Why a session cannot be resumed (its journal was corrupt at start), or None."""
        with self._lock:
            return self._corrupt.get(session_id)

    def sessions(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    # ------------------------------------------------------------------ writes
    def commit(self, session_id: str, tokens: np.ndarray, digest: str | None, reset: bool) -> bool:
        """A completed turn: `tokens` it added (reset: the whole history). Durable (fsync'd) when this returns True;
        False when the disk refused (logged and counted) or the session's start is not journaled: the session goes
        on, but would not survive a restart."""
        tokens = np.asarray(tokens, np.int64)
        now = time.time()
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None and not reset:  # its start is not on disk (dropped over budget, a failed write): a
                return False  # record of this turn alone would resume a different conversation
            self._corrupt.pop(session_id, None)
            try:
                if reset or entry is None:
                    entry = self._rewrite(session_id, tokens, digest, now)
                else:
                    self._append(entry, session_id, tokens, digest, now)
            except OSError as exc:
                self.write_failures += 1
                log.error("session journal: could not write session %r (%s); it will not survive a restart",
                          session_id, exc)
                self._entries.pop(session_id, None)
                return False
            self._entries[session_id] = entry
            self._enforce_budget(keep=session_id)
            return True

    def _rewrite(self, session_id: str, tokens: np.ndarray, digest: str | None, now: float) -> JournalEntry:
        path = self.directory / file_name(session_id)
        tmp = path.with_name(path.name + ".tmp")
        data = encode_record(session_id, RESET, tokens, digest, now)
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.directory)
        return JournalEntry(tokens.copy(), digest, now, path, len(data))

    def _append(self, entry: JournalEntry, session_id: str, tokens: np.ndarray, digest: str | None,
                now: float) -> None:
        data = encode_record(session_id, TURN, tokens, digest, now)
        with open(entry.path, "ab") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        entry.tokens = np.concatenate([entry.tokens, tokens])
        entry.digest, entry.written_at, entry.nbytes = digest, now, entry.nbytes + len(data)

    def _enforce_budget(self, keep: str) -> None:
        """Over budget: drop the least recently written sessions' journals whole (they stay live in memory but
        would not survive a restart), each logged by name."""
        total = sum(e.nbytes for e in self._entries.values())
        for session, entry in sorted(self._entries.items(), key=lambda item: item[1].written_at):
            if total <= self.budget_bytes:
                return
            if session == keep:
                continue
            total -= entry.nbytes
            entry.path.unlink(missing_ok=True)
            del self._entries[session]
            log.warning("session journal over its %d-byte budget: dropped session %r's journal (it is still live "
                        "but would not survive a restart)", self.budget_bytes, session)

    def drop(self, session_id: str) -> None:
        """The session ended or was evicted: its journal goes."""
        with self._lock:
            entry = self._entries.pop(session_id, None)
            self._corrupt.pop(session_id, None)
            path = entry.path if entry is not None else self.directory / file_name(session_id)
        path.unlink(missing_ok=True)
