"""A real tritonserver whose decoder groups tokens per streamed response (`stream_interval` 3) and alternates two
decode lanes: concurrent sessions get exactly their in-process replies, over gRPC and HTTP, in ceil(n / 3) responses
whose token ids and text add up to the reply."""

from __future__ import annotations

import math

import pytest
import tritonclient.grpc  # noqa: F401 - the serve extra installs it: a broken install must fail, not skip

from tests.conftest import EMBEDDED
from tests.tritonserver_backend.streams import reference_reply, start_server
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.client import GrpcChat, HttpChat, TurnRequest
from tritonserver_backend.core.pipeline import InProcessPipeline

pytestmark = pytest.mark.slow
INTERVAL = 3
PROMPTS = ["How do I center a div?", "grep -rn pattern . | head", "def area(r):", "Tell me about your weekend.",
           "ls -la /tmp"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    srv = start_server(tmp_path_factory.mktemp("interval"), default_engines, max_context="2048",
                       stream_interval=str(INTERVAL), decode_lanes="2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("interval_reference_registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, max_context=2048, backend="onnx", engine_dir=default_engines)


def test_grouped_responses_carry_exactly_the_solo_reply_on_concurrent_streams(server, reference) -> None:  # type: ignore[no-untyped-def]
    import threading

    requests = [TurnRequest(f"grouped-{i}", PROMPTS[i], new_session=True, max_tokens=7 + 3 * i)
                for i in range(len(PROMPTS))]
    replies: dict[int, object] = {}
    responses: dict[int, list[str]] = {}

    def run(i: int) -> None:
        chat = GrpcChat(server.grpc_url)
        try:
            responses[i] = []
            replies[i] = chat.turn(requests[i], timeout=300, on_piece=responses[i].append)
        finally:
            chat.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, request in enumerate(requests):
        reply, want = replies[i], reference_reply(reference, TurnRequest(f"ref-{i}", request.text, new_session=True,
                                                                           max_tokens=request.max_tokens))
        assert reply.error is None, reply.error
        assert reply.token_ids == want.token_ids and reply.text == want.text
        assert len(responses[i]) == math.ceil(len(want.token_ids) / INTERVAL), (len(responses[i]), len(want.token_ids))
        assert reply.finish_reason == want.finish_reason


def test_http_stream_groups_the_same_way(server, reference) -> None:  # type: ignore[no-untyped-def]
    chat = HttpChat(server.http_url)
    pieces: list[str] = []
    reply = chat.turn(TurnRequest("grouped-http", PROMPTS[0], new_session=True, max_tokens=8), on_piece=pieces.append)
    want = reference_reply(reference, TurnRequest("ref-http", PROMPTS[0], new_session=True, max_tokens=8))
    assert reply.error is None and reply.token_ids == want.token_ids
    assert len(pieces) == math.ceil(len(want.token_ids) / INTERVAL) and "".join(pieces) == want.text
