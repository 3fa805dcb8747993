"""What the real-server tests of this package share: one tritonserver per configuration (`shared_server`).

Why: a full start (six Python-backend models) costs about 25 s on the 2-core CI machine, and several modules used to
start servers of one configuration each (the 2048-token one in the exactness, grammar and speculative modules, the
4096-token one in the session-token and prefix-cache modules). A module that needs a configuration asks for it; the
first asker starts it, later ones reuse it, and every shared server stops when the package's tests are done. Tests
that share a server use their own session ids and read counters as before/after differences; destructive tests
(kills, restarts, unloads) keep a server of their own (start_server)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.tritonserver_backend.streams import start_server


@pytest.fixture(scope="package")
def shared_server(tmp_path_factory, default_engines) -> Iterator[Callable[..., Any]]:  # type: ignore[no-untyped-def]
    """`shared_server(**params)` -> the ready tritonserver with these model-config parameters (start_server's
    defaults beneath them), started on first use."""
    servers: dict[tuple[tuple[str, str], ...], Any] = {}

    def get(**params: str) -> Any:
        key = tuple(sorted({"max_context": "4096", **params}.items()))
        if key not in servers:
            servers[key] = start_server(tmp_path_factory.mktemp("shared-server"), default_engines, **dict(key))
        return servers[key]

    try:
        yield get
    finally:
        for server in servers.values():
            server.stop()
