"""The OpenAI frontend while the server heals: a model process killed, a request meanwhile gets 503 with Retry-After and
a message naming the model, and the same request succeeds once the supervisor has restarted the server, continuing the
conversation's own session (resumed from the journal, not rebuilt from the messages)."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import openai
import pytest

from benchmarks.fault_drill import probe_status, start_supervised
from tests.conftest import EMBEDDED

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def healing_stack(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    from openai_frontend.process import FrontendProcess

    work = tmp_path_factory.mktemp("openai-healing")
    params = {"model_dir": str(EMBEDDED), "registry_root": str(work / "registry"), "max_context": "2048",
              "engine_dir": str(default_engines)}
    sup = start_supervised(work, params)
    try:
        proc = FrontendProcess(sup.server.grpc_url, EMBEDDED, log_file=work / "frontend.log",
                               extra_args=["--health-url", f"{sup.probe.url}/health"]).start()
        try:
            proc.wait_ready(60)
            yield sup, proc
        finally:
            proc.stop()
    finally:
        sup.stop()


def _rebuilds(frontend) -> float:  # type: ignore[no-untyped-def]
    text = urllib.request.urlopen(f"{frontend.base_url.rsplit('/v1', 1)[0]}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^mol2_frontend_session_rebuilds_total\{[^}]*\} (\S+)$", text, re.M))


def test_a_turn_during_healing_gets_503_with_retry_after_and_succeeds_after(healing_stack) -> None:  # type: ignore[no-untyped-def]
    sup, frontend = healing_stack
    client = openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Tell me about ships."}]
    first = client.chat.completions.create(model="mol2", messages=messages, max_tokens=6, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the sea?"}]
    rebuilds = _rebuilds(frontend)

    stub = next(s for s in sup.server.snapshot().stubs if "/decoder/" in (s.model or ""))
    os.kill(stub.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while probe_status(f"{sup.probe.url}/health/ready") != 503:
        assert time.monotonic() < deadline, "the supervisor still says ready 5 s after the decoder died"
        time.sleep(0.05)

    with pytest.raises(openai.APIStatusError) as during:
        client.chat.completions.create(model="mol2", messages=messages, max_tokens=6, temperature=0)
    error = during.value
    assert error.status_code == 503, error
    assert int(error.response.headers["retry-after"]) >= 1
    body = error.response.json()["error"]
    assert "'decoder'" in body["message"] and "retry" in body["message"], body
    assert "Traceback" not in body["message"]

    deadline = time.monotonic() + 90
    while True:  # what a client honouring Retry-After does
        try:
            second = client.chat.completions.create(model="mol2", messages=messages, max_tokens=6, temperature=0)
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and time.monotonic() < deadline, exc
            time.sleep(int(exc.response.headers.get("retry-after", "1")))
    assert second.choices[0].message.content
    assert _rebuilds(frontend) == rebuilds, "the conversation's session was rebuilt instead of resumed"
