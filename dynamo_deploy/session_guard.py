"""Who may touch a session on the Dynamo path: the client that started it (its session token), and the deployment's
own workers (the internal key they share and the HMACs it signs). The Triton path's rules (tritonserver_backend/
session_auth.py), carried through what Dynamo's OpenAI frontend passes on.

What the frontend carries (ai-dynamo 1.6.1, measured with a stub worker behind `python -m dynamo.frontend`):
- client -> worker: `nvext.annotations` (a list of strings) reaches the worker as the request's `annotations`,
  unchanged. The session token travels there as one annotation, `mol2-session-token:<token>`. Other headers than
  Dynamo's session headers are not forwarded (`agent_context` holds only `session_id`, `parent_session_id`,
  `session_final`), and unknown `nvext` or top-level body fields are refused by the frontend (HTTP 400).
- worker -> client: a chunk's `engine_data` (any JSON object) comes back as `nvext.engine_data` of that chunk
  (streamed) or of the whole response (not streamed), when the request lists `"engine_data"` in
  `nvext.extra_fields`. The token issued when a session starts travels there, as `{"mol2_session_token": ...}`.

Workers reach each other on Dynamo's request plane (plain TCP on the machine's network address), where any process
that reaches the port can call `mol2.decoder.turn`, `mol2.encoder.step` and `mol2.encoder.control`. Those calls
carry no key, only HMACs under the deployment's internal key (a 0600 file in the run folder, created by the
launcher or by the first worker to start): a turn's hand-over carries the encoder's grant for (session, first
position), taken once and in order by the decoder (`GrantLedger`); a step or control call carries a signature of its
whole body and the time it was made, good for `CALL_TTL_S` and taken once (`CallAuth`). So a process without the key
can neither forge a call nor replay one it saw.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

from tritonserver_backend.auth.admin_auth import AdminKeyError
from tritonserver_backend.auth.session_auth import InternalKey, SessionRefused, refusal
from tritonserver_backend.core import counters as k

TOKEN_ANNOTATION = "mol2-session-token:"  # nvext.annotations entry a client presents its token in
ENGINE_DATA_KEY = "mol2_session_token"  # the key of the issued token in a response's nvext.engine_data
ENGINE_DATA_FIELD = "engine_data"  # what a client lists in nvext.extra_fields to receive it
CALL_TTL_S = 60.0  # a signed step/control call is accepted this long after it was signed (and once)

# refused checks, counted as `session_token_refusals/<path>` in each worker's stats
PATH_TURN = k.PATH_TURN  # encoder `generate`: a later turn of a live session id without its token
PATH_STEP, PATH_CONTROL = "step", "control"  # encoder `step` / `control` without a valid signature
PATH_HANDOVER = "handover"  # decoder `turn` without a valid grant
PATHS = (PATH_TURN, PATH_STEP, PATH_CONTROL, PATH_HANDOVER)


def presented_token(request: dict[str, Any]) -> str | None:
    """The session token a request presents (its `mol2-session-token:` annotation), or None."""
    for note in request.get("annotations") or ():
        if isinstance(note, str) and note.startswith(TOKEN_ANNOTATION):
            return note[len(TOKEN_ANNOTATION):]
    return None


def wants_engine_data(request: dict[str, Any]) -> bool:
    """Whether the client asked for `nvext.engine_data` in its response (the only way a token reaches it)."""
    extra = request.get("extra_args")
    nvext = extra.get("nvext") if isinstance(extra, dict) else None
    fields = nvext.get("extra_fields") if isinstance(nvext, dict) else None
    return isinstance(fields, list) and ENGINE_DATA_FIELD in fields


def client_nvext(token: str | None) -> dict[str, Any]:
    """The `nvext` a client sends on every turn: ask for engine_data (where a new token comes back) and present the
    session's token once it has one."""
    return {"extra_fields": [ENGINE_DATA_FIELD], **({"annotations": [TOKEN_ANNOTATION + token]} if token else {})}


def issued_token(nvext: dict[str, Any] | None) -> str | None:
    """The token a response's `nvext` issues (on the turn that started the session), or None."""
    data = (nvext or {}).get(ENGINE_DATA_FIELD)
    return data.get(ENGINE_DATA_KEY) if isinstance(data, dict) else None


def load_internal_key(path: Path, wait_s: float = 10.0) -> InternalKey:
    """The deployment's internal key from its 0600 file, created when missing. Workers that start together on a shared
    run folder race for it: the loser may find the file created but not yet written, so an unreadable key is retried
    for `wait_s` before it fails the worker."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return InternalKey.from_file(path)
        except (AdminKeyError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _scope(endpoint: str, body: dict[str, Any]) -> str:
    canonical = json.dumps({n: v for n, v in body.items() if n != "auth"}, sort_keys=True, separators=(",", ":"))
    return f"{endpoint}\x00{hashlib.sha256(canonical.encode('utf-8')).hexdigest()}"


class CallAuth:
    """Signatures on the calls workers make into each other: `sign` adds `auth` (the call's time and an HMAC of the
    endpoint, that time and the whole body under the internal key); `check` accepts a call whose signature is this
    key's, at most `ttl_s` old and not seen before (each signature is taken once). Thread-safe."""

    def __init__(self, key: InternalKey, ttl_s: float = CALL_TTL_S, remember: int = 500_000) -> None:
        self.key, self.ttl_s, self.remember = key, ttl_s, remember
        self._seen: OrderedDict[str, int] = OrderedDict()  # signature -> its time, in arrival order
        self._lock = threading.Lock()

    def sign(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "auth": self.key.grant(_scope(endpoint, body), 0)}

    def check(self, endpoint: str, body: dict[str, Any], sessions: Iterable[str]) -> None:
        """Refuse (SessionRefused, the one message, naming `sessions`) unless the call is signed, fresh and new."""
        auth = body.get("auth")
        who = ", ".join(map(str, sessions))
        try:
            issued = self.key.verify(auth if isinstance(auth, str) else None, _scope(endpoint, body), 0, self.ttl_s)
        except SessionRefused:
            raise refusal(who) from None
        cutoff = time.time_ns() - int(self.ttl_s * 1e9)
        with self._lock:
            if auth in self._seen:
                raise refusal(who)
            self._seen[auth] = issued  # type: ignore[index]
            while self._seen and (len(self._seen) > self.remember or next(iter(self._seen.values())) < cutoff):
                self._seen.popitem(last=False)  # older than the TTL: verify refuses a replay of it anyway


def anonymous_key(history: list[int]) -> str:
    """Where a conversation without `x-dynamo-session-id` is kept: a digest of its whole history (every message, the
    server's replies included, before the last user message). Only a request that resends that exact history finds
    the record, and a different conversation that shares its opening finds another."""
    return "anon-" + hashlib.sha256(",".join(map(str, history)).encode()).hexdigest()


__all__ = ["CALL_TTL_S", "CallAuth", "ENGINE_DATA_KEY", "ENGINE_DATA_FIELD", "PATHS", "PATH_CONTROL", "PATH_HANDOVER",
           "PATH_STEP", "PATH_TURN", "TOKEN_ANNOTATION", "anonymous_key", "client_nvext", "issued_token",
           "load_internal_key", "presented_token", "wants_engine_data"]
