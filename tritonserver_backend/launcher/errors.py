"""The launcher's two exceptions (shared by the install, environment and server modules)."""

from __future__ import annotations


class TritonNotFoundError(RuntimeError):
    """No usable ``tritonserver`` binary was found."""


class TritonServerError(RuntimeError):
    """The server failed to start, exited, or did not become ready; the message carries the log tail."""
