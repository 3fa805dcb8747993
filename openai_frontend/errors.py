"""Errors in the OpenAI format (`{"error": {"message", "type", "param", "code"}}`) with the status codes OpenAI
clients act on: 400 retry is pointless, 404 the model id is wrong, 429/503 back off and retry."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tritonserver_backend.auth.session_auth import REFUSAL

# what every session-token refusal says, whatever the session id ("with this session_token")
TOKEN_REFUSAL_NEEDLE = REFUSAL.partition("{session_id!r}")[2].partition(":")[0].strip().lower()


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    retry_after: int = 1  # seconds, sent as Retry-After with a 429 or 503

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.status in (429, 503) else {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", None, param)


def unknown_model(model: str, known: list[str]) -> APIError:
    return APIError(404, f"The model '{model}' does not exist; served models: {', '.join(known)}",
                    "invalid_request_error",
                    "model_not_found", "model")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", "service_unavailable")


# Triton's per-request messages (tritonserver_backend.errors) -> status, type, code. Order matters: first match wins.
_TRITON_CLASSES: tuple[tuple[str, int, str, str | None], ...] = (
    ("server busy", 429, "rate_limit_error", "server_busy"),
    ("needs the admin key", 401, "authentication_error", "admin_key_required"),
    ("wrong admin key", 403, "permission_error", "wrong_admin_key"),
    ("administration is turned off", 403, "permission_error", "admin_disabled"),
    ("admin key is not usable", 503, "server_error", "admin_key_unusable"),
    ("still answering its previous turn", 429, "rate_limit_error", "session_busy"),
    ("unknown adapter", 404, "invalid_request_error", "model_not_found"),
    (TOKEN_REFUSAL_NEEDLE, 409, "invalid_request_error", "session_refused"),
    ("unknown session", 409, "invalid_request_error", "session_lost"),
    ("was evicted", 409, "invalid_request_error", "session_lost"),
    ("was ended", 409, "invalid_request_error", "session_lost"),
    # a model's process died (Triton: "Stub process '<model>_0_0' is not healthy"): the supervisor restarts the
    # server, and the journal keeps the sessions, so the turn is retried, not given up (docs/reliability.md)
    ("is not healthy", 503, "server_error", "model_unavailable"),
    ("has no available versions", 503, "server_error", "model_unavailable"),  # a restarted server still loading
    # the supervisor is stopping the server to restart it: Triton refuses new requests while it drains
    ("has stopped accepting new inference requests", 503, "server_error", "model_unavailable"),
    ("socket closed", 503, "server_error", "service_unavailable"),
    ("connection reset", 503, "server_error", "service_unavailable"),
    ("internal error", 500, "server_error", None),
    ("failed to connect", 503, "server_error", "service_unavailable"),
    ("unavailable", 503, "server_error", "service_unavailable"),
)


def from_triton(message: str) -> APIError:
    """A Triton error message as the OpenAI error a client should see (anything unclassified is the client's 400:
    the server's own checks name bad parameters, over-long input and malformed text)."""
    lowered = message.lower()
    for needle, status, kind, code in _TRITON_CLASSES:
        if needle in lowered:
            return APIError(status, message, kind, code, retry_after=_retry_after(lowered))
    return APIError(400, message, "invalid_request_error", None)


def _retry_after(lowered: str) -> int:
    """The server's own hint ("retry after N s", tritonserver_backend.errors.ServerBusy) as Retry-After seconds."""
    match = re.search(r"retry after (\d+) s", lowered)
    return max(1, int(match.group(1))) if match else 1


def session_refused(error: APIError) -> bool:
    """The server refused the session token the frontend sent (session_auth.py): one message whether the session is
    gone (a restarted server, a forgotten eviction) or the token is not its own."""
    return error.code == "session_refused"


def session_lost(error: APIError) -> bool:
    """The server no longer holds the session the cache pointed at, or will not open it with the token the frontend
    holds: rebuild it from the messages under a new session id instead."""
    return error.code in ("session_lost", "session_refused")


HEALING_RETRY_AFTER_S = 5  # the default's restart takes 11-31 s: clients that honour Retry-After poll a few times


def explained_by(error: APIError, health: dict | None) -> APIError:
    """A 503 with what the server's supervisor says happened (its `/health`: the model whose process died, and
    whether it is healing): the message names the model and says the turn can be retried, since no session is lost."""
    if error.status != 503 or not health:
        return error
    faults = health.get("faults") or []
    state = health.get("state", "")
    if not faults or state not in ("healing", "starting", "ready"):
        return error
    fault = faults[-1]
    if state == "ready" and fault.get("healed_at") is None:
        return error
    doing = ("the server is healing: retry the request in a few seconds" if state != "ready"
             else "the server has healed: retry the request")
    message = (f"model {fault.get('model')!r} stopped ({fault.get('kind')}); {doing}; every session is kept "
               f"(the turn that was answering is not in its history). [{error.message}]")
    return APIError(503, message, "server_error", "model_unavailable",
                    retry_after=HEALING_RETRY_AFTER_S if state != "ready" else 1)
