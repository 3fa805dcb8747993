"""Who may touch a session: the client that started it (its session token), and this server's own models (the
internal key and the grants it signs).

A session id is chosen by the client and is usually guessable (a user name, a counter), yet the encoder state, the
global KV and the rings of a conversation all sit behind it. So the server issues a session token when a session
starts: 144 random bits (`secrets`), returned once on the turn that started it. Every later turn, cancel or end, and
a restart of a live id (`new_session`, or `history` sent for an id that is live), must present it. What is kept is
the token's SHA-256 digest, compared with `hmac.compare_digest`, so neither a log line nor a memory dump of the
stores gives a usable token, and the comparison's time does not depend on how much of a guess was right.

A refused request gets one message (`REFUSAL`) whether the session exists, was ended or never existed. Only a client
that presents the token of a session that is gone learns why it is gone (evicted or ended), since it owned it.

The models of one server also talk to each other through inputs any client could send (the encoder's STEP / ROLLBACK
/ DROP inputs, the decoder's CONTROL and hand-over rows): a client calling `encoder` or `decoder` directly must not
advance, drop, cancel or overwrite someone's session that way. Those calls carry the server's internal key (a 0600
file beside the admin key, created at the first start), and the hand-over the encoder sends the decoder carries a
grant: an HMAC under that key of the session id, the hand-over's first position and the time it was issued. The
decoder takes a grant once, only while fresh, and only if it is newer than the session's last one; one that a client
obtains by calling the encoder directly for its own session is good for that session's next turn only.

`session_auth` off (a trusted single-tenant deployment) turns the tokens off; the internal key stays on.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path

from tritonserver_backend.errors import ServingError, UnknownSession

TOKEN_BYTES = 18  # 144 random bits, 24 URL-safe characters
INTERNAL_KEY_FILE = "internal.key"
GRANT_TTL_S = 300.0  # a hand-over's grant is good this long after the encoder signed it
REFUSAL = ("no live session {session_id!r} with this session_token: a session's later turns, cancel and end need the "
           "session_token issued on its first reply (issued_session_token); to go on, start a session with new_session "
           "or resend the conversation with history (under another session_id if this one is in use)")


class SessionRefused(ServingError):
    """A missing or wrong session token (or an unknown session). One message for all of them."""


def refusal(session_id: str) -> SessionRefused:
    return SessionRefused(REFUSAL.format(session_id=session_id))


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def token_digest(token: str | None) -> str:
    """Hex SHA-256 of a token; "" for none (no token ever digests to "")."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest() if token else ""


def parse_switch(value: str | bool | None, name: str = "session_auth") -> bool:
    """A model config switch: true/on/1/yes or false/off/0/no (anything else is a configuration error)."""
    if isinstance(value, bool):
        return value
    text = (value or "").strip().lower()
    if text in ("", "true", "on", "1", "yes"):
        return True
    if text in ("false", "off", "0", "no"):
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")


class SessionTokens:
    """The token digest of every live session, and of recently gone ones (bounded) so that their owner can be told
    why the session is gone. Thread-safe. With `enabled` false nothing is issued and every check passes."""

    def __init__(self, enabled: bool = True, remember: int = 10_000) -> None:
        self.enabled, self.remember = enabled, remember
        self._live: dict[str, str] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def issue(self, session_id: str) -> str:
        """A fresh token for a session that (re)starts now (replacing any earlier one); "" when tokens are off."""
        if not self.enabled:
            return ""
        token = new_token()
        with self._lock:
            self._live[session_id] = token_digest(token)
            self._gone.pop(session_id, None)
        return token

    def adopt(self, session_id: str, digest: str) -> None:
        """Take a session's digest as another model issued it (the decoder learns it with the hand-over)."""
        with self._lock:
            self._live[session_id] = digest
            self._gone.pop(session_id, None)
            while len(self._live) > 4 * self.remember:  # a decoder that never hears of evictions stays bounded
                self._live.pop(next(iter(self._live)))

    def restore(self, session_id: str, digest: str | None) -> None:
        """Put back the digest a session had before a turn that was rolled back (None: it had no session)."""
        with self._lock:
            if digest is None:
                self._live.pop(session_id, None)
            else:
                self._live[session_id] = digest

    def digest(self, session_id: str) -> str | None:
        with self._lock:
            return self._live.get(session_id)

    def matches(self, session_id: str, token: str | None) -> bool:
        """Whether `token` is the live session's token (always true with tokens off)."""
        if not self.enabled:
            return True
        with self._lock:
            held = self._live.get(session_id)
        return held is not None and hmac.compare_digest(held, token_digest(token) or "-")

    def check(self, session_id: str, token: str | None) -> None:
        """Refuse (SessionRefused) unless `token` is the live session's; with tokens off, pass."""
        if not self.matches(session_id, token):
            raise refusal(session_id)

    def check_gone(self, session_id: str, token: str | None, reason: UnknownSession) -> None:
        """A request for a session that is not live: the owner of a gone session learns why (`reason`); anyone
        else gets the one refusal message. With tokens off the reason goes to whoever asks, as before."""
        if not self.enabled:
            raise reason
        with self._lock:
            held = self._gone.get(session_id)
        if held is not None and hmac.compare_digest(held, token_digest(token) or "-"):
            raise reason
        raise refusal(session_id)

    def forget(self, session_id: str) -> None:
        """The session ended or was evicted: its token no longer opens anything, but its owner is told why."""
        with self._lock:
            held = self._live.pop(session_id, None)
            if held is not None:
                self._gone[session_id] = held
                self._gone.move_to_end(session_id)
                while len(self._gone) > self.remember:
                    self._gone.popitem(last=False)


class InternalKey:
    """The secret this server's models share (a 0600 file, created by whichever model starts first): it signs the
    encoder's hand-over for the decoder and authenticates the calls the models make into each other."""

    def __init__(self, secret: str) -> None:
        if len(secret) < 32:
            raise ValueError("the internal key needs at least 32 characters")
        self._secret = secret.encode("utf-8")
        self._last_ns = 0
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | Path) -> "InternalKey":
        from tritonserver_backend.auth.admin_auth import (
            ensure_admin_key,  # the same exclusive-create, 0600-checked key file
        )

        return cls(ensure_admin_key(path))

    def matches(self, presented: str | None) -> bool:
        return hmac.compare_digest(self._secret, (presented or "").encode("utf-8"))

    @property
    def value(self) -> str:
        """For this server's own BLS calls only; never logged or returned to a client."""
        return self._secret.decode("utf-8")

    def _mac(self, session_id: str, first_position: int, issued_ns: int) -> str:
        message = f"{session_id}\x00{first_position}\x00{issued_ns}".encode("utf-8")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def grant(self, session_id: str, first_position: int, turn_id: int = 0) -> str:
        """The encoder's signature on a turn's hand-over: this session, rows from this position on, issued now
        (strictly later than any grant before it, so the decoder can take each grant once and in order). `turn_id`
        (the turn's lease, turn_lease.py: itself the encoder's clock at the hand-over) is signed as the issue time,
        so the decoder learns the turn's id from the grant it checks anyway."""
        with self._lock:
            if turn_id and turn_id <= self._last_ns:
                raise ValueError(f"turn id {turn_id} is not newer than this key's last grant ({self._last_ns})")
            self._last_ns = issued = int(turn_id) if turn_id else max(time.time_ns(), self._last_ns + 1)
        return f"{issued}:{self._mac(session_id, first_position, issued)}"

    def verify(self, grant: str | None, session_id: str, first_position: int, ttl_s: float = GRANT_TTL_S) -> int:
        """The grant's issue time when it is this key's, for this session and position, and at most `ttl_s` old;
        else SessionRefused (the decoder answers a direct call without a valid grant like any other refusal)."""
        issued_text, _, mac = (grant or "").partition(":")
        try:
            issued = int(issued_text)
        except ValueError:
            raise refusal(session_id) from None
        fresh = abs(time.time_ns() - issued) <= ttl_s * 1e9
        if not (hmac.compare_digest(self._mac(session_id, first_position, issued), mac) and fresh):
            raise refusal(session_id)
        return issued


class GrantLedger:
    """The decoder's memory of the newest grant it took per session (bounded, least recently used forgotten): a
    grant is taken once, and never one older than the session's last (so an unused grant a client got by calling the
    encoder directly cannot later overwrite a session that has moved on)."""

    def __init__(self, remember: int = 100_000) -> None:
        self.remember = remember
        self._last: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, session_id: str, issued_ns: int) -> None:
        with self._lock:
            if issued_ns <= self._last.get(session_id, 0):
                raise refusal(session_id)
            self._last[session_id] = issued_ns
            self._last.move_to_end(session_id)
            while len(self._last) > self.remember:
                self._last.popitem(last=False)


def grant_subject(session_id: str, fork_from: str | None = None) -> str:
    """What a hand-over's grant signs as its session: the session, and for a fork (contract.FORK_FROM) the source too,
    so that a grant the encoder gave for one fork cannot copy another session's decoder state."""
    return session_id if fork_from is None else f"{session_id}\x00fork\x00{fork_from}"


def first_position(positions) -> int:  # type: ignore[no-untyped-def]
    """The position a grant signs: the hand-over's first row, -1 for none (a fork that adds no tokens)."""
    return int(positions[0]) if len(positions) else -1


def internal_key_path(registry_root: str | Path, key_file: str | Path | None = None) -> Path:
    return Path(key_file) if key_file else Path(registry_root) / INTERNAL_KEY_FILE
