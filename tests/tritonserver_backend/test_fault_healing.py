"""Faults through a real tritonserver under the supervisor: every Python-backend model's process SIGKILLed in the
middle of a stream, tritonserver itself SIGKILLed between turns, a stop and a start, a corrupt journal record.

Each time: the open stream ends with an error within 10 s, the supervisor's readiness says not ready within 5 s
while liveness stays up, the server serves again within 60 s with nobody acting, no shared-memory region of the dead
server is left, and every open session's next turn (the killed one retried, and the others) equals what the
in-process pipeline, which never died, answers to the same conversation, token for token (greedy)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from benchmarks.fault_drill import (
    MirroredConversations,
    kill_mid_stream,
    probe_status,
    start_supervised,
    stub_pid,
)
from tests.conftest import EMBEDDED
from tritonserver_backend import contract as c
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.client import GrpcChat
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.core.session_journal import file_name

pytestmark = pytest.mark.slow

MODELS = [m.name for m in c.MODELS if m.name != c.ENSEMBLE_NAME]
SESSIONS = [f"s{i}" for i in range(8)]
ERROR_WITHIN_S, NOT_READY_WITHIN_S, HEALED_WITHIN_S = 10.0, 5.0, 60.0


def _turn(talk: MirroredConversations, r) -> None:  # type: ignore[no-untyped-def]
    exchange = talk.turn(r)
    assert exchange.reply.error is None, f"{r.session_id}: {exchange.reply.error}"
    assert exchange.equal, (r.session_id, exchange.reply.token_ids, exchange.expected.token_ids)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("reference_registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, max_context=2048, backend="onnx", engine_dir=default_engines)


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    from tritonserver_backend.launcher.restart_policy import RestartPolicy

    work = tmp_path_factory.mktemp("faults")
    params = {"model_dir": str(EMBEDDED), "registry_root": str(work / "registry"), "max_context": "2048",
              "engine_dir": str(default_engines)}

    def start(ports: dict | None = None):  # type: ignore[no-untyped-def]
        policy = RestartPolicy(max_restarts=len(MODELS) + 4, delays=(0.0,))
        return start_supervised(work, params, policy, ports)

    holder = {"sup": start(), "start": start, "journal": work / "server" / "sessions"}
    yield holder
    holder["sup"].stop()


@pytest.fixture(scope="module")
def conversations(served, reference):  # type: ignore[no-untyped-def]
    talk = MirroredConversations(served["sup"].server.grpc_url, reference)
    for session in SESSIONS:
        _turn(talk, talk.request(session, new=True))
        _turn(talk, talk.request(session))
    return talk


@pytest.mark.parametrize("model", MODELS)
def test_a_killed_model_process_heals_and_keeps_every_session(served, conversations, model: str) -> None:  # type: ignore[no-untyped-def]
    sup, talk = served["sup"], conversations
    faults_before = len(sup.faults)
    killed_session = SESSIONS[MODELS.index(model) % 4]
    request = talk.request(killed_session, long=True)
    timings = kill_mid_stream(sup, talk, request, stub_pid(sup, model), bound_s=HEALED_WITHIN_S)
    assert timings.error is not None and timings.error <= ERROR_WITHIN_S, timings
    assert timings.reply is not None and timings.reply.error and timings.reply.finish_reason == "", timings.reply
    assert timings.not_ready is not None and timings.not_ready <= NOT_READY_WITHIN_S, timings
    assert timings.live_held, "liveness must hold while healing"
    assert timings.healed is not None and timings.healed <= HEALED_WITHIN_S, timings
    assert not timings.regions_left, f"the dead server's shared-memory regions were left: {timings.regions_left}"
    fault = sup.faults[faults_before]
    assert fault.model == model and fault.kind == "stub exited", fault
    _turn(talk, request)  # the killed turn, retried: completed now, and not in the history twice
    for session in [s for s in SESSIONS[:4] if s != killed_session][:3]:
        _turn(talk, talk.request(session))
    _turn(talk, talk.request(f"after-{model}", new=True))  # a session started after healing


def test_a_killed_tritonserver_heals_and_keeps_eight_sessions(served, conversations) -> None:  # type: ignore[no-untyped-def]
    sup, talk = served["sup"], conversations
    faults_before = len(sup.faults)
    old = sup.server.pid
    killed = time.monotonic()
    os.kill(old, signal.SIGKILL)
    while probe_status(f"{sup.probe.url}/health/ready") != 503 or len(sup.faults) == faults_before:
        assert time.monotonic() - killed < NOT_READY_WITHIN_S, "the supervisor did not notice the dead tritonserver"
        time.sleep(0.05)
    sup.wait_state("ready", timeout=HEALED_WITHIN_S)
    assert sup.server.pid != old and sup.faults[faults_before].model == "tritonserver"
    for session in SESSIONS:
        _turn(talk, talk.request(session))


def test_stop_and_start_keep_sessions_and_a_corrupt_journal_loses_only_its_session(served, conversations) -> None:  # type: ignore[no-untyped-def]
    talk = conversations
    old = served["sup"]
    old.stop()
    path = served["journal"] / file_name("s7")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # the last record's payload: its checksum no longer holds
    path.write_bytes(bytes(data))
    served["sup"] = served["start"]({k: old.start_kwargs[k] for k in ("http_port", "grpc_port", "metrics_port")})
    assert served["sup"].server.grpc_url == talk.url, "a restart must listen where clients connect"
    for session in SESSIONS[:7]:
        _turn(talk, talk.request(session))
    chat = GrpcChat(talk.url, talk.tokens)
    try:
        refused = chat.turn(talk.request("s7"), timeout=60)
    finally:
        chat.close()
    assert refused.error and "'s7' cannot be resumed" in refused.error and "corrupt" in refused.error, refused.error
