"""Serving under load on a real tritonserver with small admission bounds: busy errors at once, cancelled turns free
their row and keep the session consistent. (A server killed mid-conversation: test_fault_healing.py.)"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc  # noqa: F401 - the serve extra installs it: a broken install must fail, not skip

from tests.conftest import EMBEDDED
from tests.tritonserver_backend.streams import start_server
from tests.waiting import wait_until
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.client import GrpcChat, TurnRequest, cancel_turn
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.sampling.sampler import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # its subject is load: it runs alone, after the rest
LONG = 1500  # tokens: a turn that runs for seconds
LEASE_S = 4  # the small server's turn lease: how long a turn nobody continues may hold its slot


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    server = start_server(tmp_path_factory.mktemp("load"), default_engines, max_active_turns="2", max_queued_turns="1",
                          turn_lease_s=str(LEASE_S))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("load_reference_registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, max_context=4096, backend="onnx", engine_dir=default_engines)


LongTurns = tuple[list[threading.Thread], list, list[GrpcChat], list[list[str]]]


def _long_turns(server, count: int, prefix: str) -> LongTurns:  # type: ignore[no-untyped-def]
    """`count` long turns started on their own streams; returns the threads, their replies, the chats and the pieces
    each has streamed so far (a turn with pieces holds a decoder row: it is active, not queued)."""
    replies: list = [None] * count
    pieces: list[list[str]] = [[] for _ in range(count)]
    chats = [GrpcChat(server.grpc_url) for _ in range(count)]

    def run(i: int) -> None:
        request = TurnRequest(f"{prefix}{i}", "Tell me a very long story about ships.", new_session=True,
                              max_tokens=LONG)
        replies[i] = chats[i].turn(request, timeout=300, on_piece=pieces[i].append)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, replies, chats, pieces


def _decisions_written(server) -> float:  # type: ignore[no-untyped-def]
    """The router's `mol2_routing_decisions_written` over every adapter: one per turn encoded and routed (the turn
    is then in flight: counted against the admission bounds until it ends)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mol2_routing_decisions_written"))


def _direct_encoder_turn(server, session: str) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """A user turn sent straight to the `encoder` model over HTTP, as a client with no key can: -> (status, body)."""
    body = {"inputs": [{"name": "session_id", "shape": [1], "datatype": "BYTES", "data": [session]},
                       {"name": "TOKEN_IDS", "shape": [3], "datatype": "INT64", "data": [10, 11, 12]},
                       {"name": "PREFIX_IDS", "shape": [0], "datatype": "INT64", "data": []},
                       {"name": "START", "shape": [1], "datatype": "BOOL", "data": [True]}]}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/encoder/infer",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_turns_nobody_continues_cannot_lock_the_server(small_server) -> None:  # type: ignore[no-untyped-def]
    """200 turns sent straight to the encoder, never continued to the decoder (issue 63: 96 of them used to lock
    every user out until a restart). They take the slots; while they hold them the refusal is "server busy" with a
    retry hint, as HTTP 503 (`infer`) and gRPC UNAVAILABLE, never 500 (Triton's `generate` extension answers any
    model error with 400); once their lease has passed, turns through `mol2` are served again, and the metric counts
    the expired leases."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    statuses = [_direct_encoder_turn(small_server, f"ghost-{i}") for i in range(200)]
    accepted = [s for s, _ in statuses if s == 200]
    refused = [(s, text) for s, text in statuses if s != 200]
    assert len(accepted) == 3, statuses[:5]  # the bound: 2 active rows + 1 queued
    assert all(s == 503 and "server busy" in text and "retry after" in text for s, text in refused), refused[:3]
    request = urllib.request.Request(f"http://{small_server.http_url}/v2/models/mol2/generate", data=json.dumps(
        {"session_id": "after-ghosts", "text": "Hello?", "new_session": True, "max_tokens": 4,
         "stream": False}).encode())
    with pytest.raises(urllib.error.HTTPError) as busy:
        urllib.request.urlopen(request, timeout=60)
    answer = busy.value.read().decode()  # Triton's generate extension answers every model error with 400
    assert "server busy" in answer and "retry after" in answer, (busy.value.code, answer)
    refused_chat = GrpcChat(small_server.grpc_url).turn(TurnRequest("after-ghosts", "Hello?", new_session=True,
                                                                     max_tokens=4), timeout=60)
    assert refused_chat.error is not None and "retry after" in refused_chat.error, refused_chat
    client = grpcclient.InferenceServerClient(small_server.grpc_url)
    values = {"session_id": np.asarray([b"ghost-grpc"], object), "TOKEN_IDS": np.asarray([10, 11, 12], np.int64),
              "PREFIX_IDS": np.zeros(0, np.int64), "START": np.asarray([True])}
    inputs = []
    for name, value in values.items():
        datatype = {"O": "BYTES", "i": "INT64", "b": "BOOL"}[value.dtype.kind]
        tensor = grpcclient.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    with pytest.raises(InferenceServerException) as unavailable:
        client.infer("encoder", inputs)
    assert unavailable.value.status() == "StatusCode.UNAVAILABLE" and "retry after" in str(unavailable.value)
    chat = GrpcChat(small_server.grpc_url)

    def served() -> bool:
        reply = chat.turn(TurnRequest("after-ghosts", "Hello?", new_session=True, max_tokens=4), timeout=60)
        assert reply.error is None or "server busy" in reply.error, reply
        return reply.error is None and bool(reply.token_ids)

    wait_until(served, 3 * LEASE_S + 30, "a turn through mol2 served once the abandoned turns' leases passed",
               interval=0.5)
    chat.close()
    text = urllib.request.urlopen(small_server.metrics_url, timeout=10).read().decode()
    expired = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith('mol2_turn_leases_ended{how="expired"}'))
    assert expired >= 3


def test_beyond_the_bounds_a_turn_gets_server_busy_at_once(small_server) -> None:  # type: ignore[no-untyped-def]
    before = _decisions_written(small_server)
    threads, replies, chats, pieces = _long_turns(small_server, 3, "busy")  # 2 active rows + 1 queued = the bounds
    wait_until(lambda: _decisions_written(small_server) - before >= 3, 120, "all three turns encoded and routed")
    wait_until(lambda: sum(1 for p in pieces if p) >= 2, 120, "two of them streaming (the two active rows)")
    extra = GrpcChat(small_server.grpc_url)
    started = time.perf_counter()
    reply = extra.turn(TurnRequest("busy-extra", "Hello?", new_session=True, max_tokens=4), timeout=60)
    waited = time.perf_counter() - started
    assert reply.error is not None and "server busy" in reply.error and "retry" in reply.error, reply
    # the promise is "at once", not after a row frees (the long turns hold theirs for minutes); 2 s leaves a wide
    # margin over the milliseconds it takes on a loaded 2-core machine
    assert waited < 2.0, f"the busy error took {waited * 1000:.0f} ms"
    # each turn started its session: its token came first, before any token (a queued turn's too), so its owner cancels
    wait_until(lambda: all(chats[i].tokens.get(f"busy{i}") for i in range(3)), 60,
               "every session's token at its client")
    outcomes = [cancel_turn(small_server.http_url, f"busy{i}", chats[i].tokens.get(f"busy{i}"))["outcome"]
                for i in range(3)]
    for t in threads:
        t.join(timeout=120)
    for outcome, reply in zip(outcomes, replies):
        if outcome.startswith("cancelled before it started"):  # a queued turn: a clear error, nothing was kept
            assert reply.error is not None and "cancelled before it started" in reply.error
        else:  # an active turn: ends as "cancelled" with its partial reply
            assert "partial reply stays" in outcome and reply.error is None and reply.finish_reason == "cancelled", (
                outcome, reply)
    after = extra.turn(TurnRequest("busy-extra", "Hello again?", new_session=True, max_tokens=4), timeout=60)
    assert after.error is None and after.token_ids, "once rows are free, turns are served again"
    for chat in chats + [extra]:
        chat.close()


def test_a_cancelled_turn_frees_its_row_and_keeps_its_partial_reply(small_server, reference) -> None:  # type: ignore[no-untyped-def]
    threads, replies, chats, pieces = _long_turns(small_server, 2, "cut")
    wait_until(lambda: pieces[0], 120, "cut0 to stream its first piece (active, with a partial reply to keep)")
    outcome = cancel_turn(small_server.http_url, "cut0", chats[0].tokens.get("cut0"))
    assert "partial reply stays" in outcome["outcome"], outcome
    threads[0].join(timeout=60)
    cut = replies[0]
    assert cut.error is None and cut.finish_reason == "cancelled" and 0 < len(cut.token_ids) < LONG
    # the row is free at once: a new session is served while cut1 still runs
    chat = GrpcChat(small_server.grpc_url)
    started = time.perf_counter()
    assert chat.turn(TurnRequest("cut-new", "Hi", new_session=True, max_tokens=4)).token_ids
    assert time.perf_counter() - started < 5.0
    # the session goes on, with the partial reply in its history: the same next reply as a session whose first turn
    # stopped after exactly those tokens
    nxt = chat.turn(TurnRequest("cut0", "And then what happened?", max_tokens=8,
                                session_token=chats[0].tokens.get("cut0")))
    reference.chat("ref-cut", "Tell me a very long story about ships.", new_session=True,
                   params=SamplingParams(max_tokens=len(cut.token_ids)))
    want = reference.chat("ref-cut", "And then what happened?", params=SamplingParams(max_tokens=8))
    assert nxt.error is None and nxt.token_ids == want.token_ids
    assert cancel_turn(small_server.http_url, "cut0", chats[0].tokens.get("cut0"))["outcome"] == "no turn in flight"
    cancel_turn(small_server.http_url, "cut1", chats[1].tokens.get("cut1"))
    threads[1].join(timeout=60)
    for c in chats + [chat]:
        c.close()

