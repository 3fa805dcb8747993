"""Faults through a real tritonserver under the supervisor: every Python-backend model's process SIGKILLed in the
middle of a stream, tritonserver itself SIGKILLed between turns, a stop and a start, a corrupt journal record.

Each time: the open stream ends with an error within 10 s, the supervisor's readiness says not ready within 5 s
while liveness stays up, the server serves again within 60 s with nobody acting, no shared-memory region of the dead
server is left, and every open session's next turn (the killed one retried, and the others) equals what the
in-process pipeline, which never died, answers to the same conversation, token for token (greedy). And without a
supervisor: a server SIGKILLed and started again by hand in the same work dir continues every conversation."""

from __future__ import annotations

import json
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
from tests.tritonserver_backend.streams import start_server
from tritonserver_backend import contract as c
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.client import GrpcChat, SessionTokens, TurnRequest
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.core.session_journal import file_name
from tritonserver_backend.sampling.sampler import SamplingParams

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


CONVERSATION = ["Hi! How was your day?", "def mean(xs):\n    return sum(xs) / len(xs)",
                "Make the header sticky with a shadow.", "git log --oneline shows nothing, why?"]


def test_a_killed_server_continues_each_conversation_exactly(tmp_path, default_engines, reference) -> None:  # type: ignore[no-untyped-def]
    """Without a supervisor: SIGKILL mid-conversation, start again in the same work dir: nothing of the dead server
    is left (stubs, shared memory), and each conversation goes on with exactly the undisturbed replies: resumed from
    the server's session journal under the token it had, or resent with `history` (which rebuilds it from the
    client's side)."""
    from tritonserver_backend.launcher import group_members, mapped_shm_regions

    work = tmp_path / "crash"
    server = start_server(work, default_engines, max_context="2048")  # as the module's reference
    sessions = {f"crash{i}": [] for i in range(3)}
    tokens = SessionTokens()  # the clients keep their sessions' tokens across the server's death
    for sid, history in sessions.items():
        chat = GrpcChat(server.grpc_url, tokens)
        for turn, text in enumerate(CONVERSATION[:2]):
            reply = chat.turn(TurnRequest(sid, text, new_session=turn == 0, max_tokens=12))
            assert reply.error is None
            history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply.text}]
        chat.close()
    old_pid = server.pid
    old_group = group_members(old_pid)
    old_regions = mapped_shm_regions(old_group)
    # what must be gone after the restart is there now (the server, a stub per model, their regions): else the
    # "nothing left" checks below would pass on empty lists
    assert old_pid in old_group and len(old_group) > 1, f"the server's process group before the kill: {old_group}"
    assert old_regions and all(r.exists() for r in old_regions), f"its shared-memory regions: {old_regions}"
    os.kill(old_pid, signal.SIGKILL)
    server.process.wait(timeout=30)
    restarted = start_server(work, default_engines, max_context="2048")
    try:
        assert not [p for p in group_members(old_pid)], "stubs of the killed server are gone"
        assert not [r for r in old_regions if r.exists()], "its shared-memory regions are gone"
        for i, (sid, history) in enumerate(sessions.items()):
            chat = GrpcChat(restarted.grpc_url, tokens)
            if i == 0:  # a stranger's token opens nothing, journaled or not
                refused = chat.turn(TurnRequest(sid, CONVERSATION[2], max_tokens=12, session_token="not-its-token"))
                assert refused.error is not None and f"no live session {sid!r}" in refused.error
            sent_history = json.dumps(history) if i == 2 else None
            resumed = chat.turn(TurnRequest(sid, CONVERSATION[2], history=sent_history, max_tokens=12))
            assert bool(resumed.session_token) == (i == 2), "a journaled session keeps its token; history issues one"
            for turn, text in enumerate(CONVERSATION[:2]):  # the undisturbed conversation, in process
                reference.chat(f"ref-{sid}", text, new_session=turn == 0, params=SamplingParams(max_tokens=12))
            want = reference.chat(f"ref-{sid}", CONVERSATION[2], params=SamplingParams(max_tokens=12))
            assert resumed.error is None and resumed.token_ids == want.token_ids and resumed.adapter == want.adapter
            chat.close()
    finally:
        restarted.stop()
