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
    """Admission control refused the request at once (too many turns in flight); the client should retry later."""


class TurnFailed(ServingError):
    """The decoder's scheduler failed unexpectedly while the turn was in flight: the turn was rolled back, and the
    session keeps its earlier turns (the client may resend it)."""


class TurnCancelled(ServingError):
    """The client cancelled the turn (session_control "cancel")."""
