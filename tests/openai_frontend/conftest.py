"""A real tritonserver (the embedded default) and the real frontend process beside it, on loopback ports, shared by this
package's slow tests.

The server runs the PyTorch reference engine: it needs no engine build, so these tests neither wait for nor rewrite
the shared ONNX engines in artifacts/engines (what the frontend does is the same on every engine backend)."""

from __future__ import annotations

import re
import urllib.request

import openai
import pytest
import tritonclient.grpc  # noqa: F401 - the serve extra installs it: a broken install must fail, not skip

from ced.text.tokenizer import ChatTokenizer
from tests.conftest import EMBEDDED


@pytest.fixture(scope="session")
def tokenizer() -> ChatTokenizer:
    """The embedded default's tokenizer: what the frontend's unit tests render and count with."""
    return ChatTokenizer.load(EMBEDDED)


@pytest.fixture(scope="session")
def triton(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tritonserver_backend.launcher import TritonServer
    from tritonserver_backend.repository import build_repository

    work = tmp_path_factory.mktemp("openai-triton")
    # one turn in flight at most: a second concurrent turn is the busy case (429)
    params = {"model_dir": str(EMBEDDED), "registry_root": str(work / "registry"), "max_context": "2048",
              "engine_backend": "torch", "max_active_turns": "1", "max_queued_turns": "0"}
    srv = TritonServer(work_dir=work / "server")
    srv.registry_root = work / "registry"  # its admin.key and adapters/ (docs/admin.md)
    srv.start(build_repository(work / "repo", params))
    try:
        srv.wait_ready(240)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def frontend(triton, tmp_path_factory):  # type: ignore[no-untyped-def]
    from openai_frontend.process import FrontendProcess

    log = tmp_path_factory.mktemp("openai-frontend") / "frontend.log"
    proc = FrontendProcess(triton.grpc_url, EMBEDDED, log_file=log).start()
    try:
        proc.wait_ready(60)
        yield proc
    finally:
        proc.stop()


TENANT_KEYS = ("sk-tenant-a", "sk-tenant-b")


@pytest.fixture(scope="session")
def keyed_frontend(triton, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A second frontend on the same server with two API keys (two tenants): each key has its own cache partition."""
    from openai_frontend.process import FrontendProcess

    log = tmp_path_factory.mktemp("openai-frontend-keyed") / "frontend.log"
    args = [arg for key in TENANT_KEYS for arg in ("--api-key", key)]
    proc = FrontendProcess(triton.grpc_url, EMBEDDED, log_file=log, extra_args=args).start()
    try:
        proc.wait_ready(60)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(frontend):  # type: ignore[no-untyped-def]
    c = openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def server_counter(triton, name: str, label: str, value: str) -> int:  # type: ignore[no-untyped-def]
    """A server counter `mol2_<name>{label="value"}` from the metrics port (0 before its first increment)."""
    text = urllib.request.urlopen(triton.metrics_url, timeout=10).read().decode()
    m = re.search(rf'^mol2_{name}{{{label}="{value}"}} (\S+)$', text, re.M)
    return int(float(m.group(1))) if m else 0


def encoded_tokens(triton, kind: str = "turn") -> int:  # type: ignore[no-untyped-def]
    """The encoder's `mol2_encoded_tokens{kind=...}` counter from the metrics port (0 before its first increment)."""
    return server_counter(triton, "encoded_tokens", "kind", kind)


def token_refusals(triton, path: str = "turn") -> int:  # type: ignore[no-untyped-def]
    """The server's `mol2_session_token_refusals{path=...}` (turn: turns, ends, restarts; cancel: session_control)."""
    return server_counter(triton, "session_token_refusals", "path", path)
