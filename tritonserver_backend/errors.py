"""Errors a client may see: short, typed, one line; tracebacks stay in the server log."""

from __future__ import annotations


class ServingError(Exception):
    """A request that cannot be served as sent; its message goes to that client only."""


class UnknownSession(ServingError):
    pass


class BadRequest(ServingError):
    pass


class UnknownAdapter(ServingError):
    pass


class TurnRejected(ServingError):
    """The decoder refused a turn before absorbing it: the encoder must roll the turn back (nothing is lost)."""


class ServerBusy(ServingError):
    """Admission control refused the request at once (too many turns in flight); the client should retry later.

    Served as Triton's UNAVAILABLE: HTTP 503 and gRPC UNAVAILABLE, the codes a client library or a load balancer
    reads as "try again" (a 500 reads as a server bug). Triton's HTTP server sets no Retry-After header for a model's
    error, so the message carries the hint (`retry after N s`), and the OpenAI frontend turns it into the header."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(f"{message}; retry after {max(1, round(retry_after_s))} s")


class TurnFailed(ServingError):
    """The decoder's scheduler failed unexpectedly while the turn was in flight: the turn was rolled back, and the
    session keeps its earlier turns (the client may resend it)."""


class TurnCancelled(ServingError):
    """The client cancelled the turn (session_control "cancel")."""


class TurnNotDurable(ServingError):
    """The turn was answered and both sides keep it, but its journal record could not be written (a full or failing
    disk): the session goes on in memory and will not survive a restart. Sent as the turn's final response, so the
    client learns it at once; resending the turn would add it twice."""
