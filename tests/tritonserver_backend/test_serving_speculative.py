"""Speculative decoding through a real tritonserver: greedy replies equal plain decoding token for token.

Two servers: one as rendered by default (`speculative=auto`, which runs the embedded default's DSpark drafter, the
engines' drafter graph over each turn's `draft_main` rows), and one with the n-gram drafter (`speculative=ngram`).
The decoder's steps feed drafts; the encoder model absorbs each speculative step only up to the kept length that
rides on the next BLS step call (STEP_KEEP). Four multi-turn
conversations with routed turns and adapter switches run at once (their speculative steps are batched), one turn
opts out with `speculative` false, and every reply must equal the in-process pipeline's plain reply on the same
engines. The metrics endpoint must show drafts verified and accepted, per adapter.
"""

from __future__ import annotations

import urllib.request

import pytest

from tests.tritonserver_backend.in_process import onnx_pipeline
from tests.tritonserver_backend.streams import concurrent_token_ids, reference_reply, start_server
from tritonserver_backend.clients.client import TurnRequest

pytestmark = pytest.mark.slow

CONVERSATIONS = [
    [("Write a haiku about the sea.", None, 24), ("Now as a python function that prints it.", "L2_code", 20),
     ("Explain what the function does.", "L0_chat", 16)],
    [("How do I undo the last git commit?", None, 20), ("And if I already pushed it?", "L1_agent", 18),
     ("Make the page header sticky.", "L3_design", 16)],
    [("Center a div in CSS, please.", "L3_design", 24), ("What did I ask first?", None, 20),
     ("Thanks, that helps.", "base", 12)],
    [("Plan a three-step deployment for a web app.", None, 22), ("Now in one sentence.", "L1_agent", 18),
     ("def mean(xs):\n    return sum(xs) / len(xs)", None, 16)],
]
OPTED_OUT = (3, 1)  # conversation, turn: sent with speculative false


@pytest.fixture(scope="module", params=["default", "ngram"])
def server(request, shared_server, tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    """The default drafter is the shared 2048-token server (conftest.py); n-gram drafting has one of its own, stopped
    with the module."""
    if request.param == "default":
        yield shared_server(max_context="2048")
        return
    srv = start_server(tmp_path_factory.mktemp("speculative"), default_engines, max_context="2048",
                       speculative=request.param)
    try:
        yield srv
    finally:
        srv.stop()


def counter(server, name: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """mol2_<name> by adapter label, from the metrics port."""
    values: dict[str, float] = {}
    for line in urllib.request.urlopen(server.metrics_url).read().decode().splitlines():
        if line.startswith(f"mol2_{name}{{"):
            label = line.split('adapter="', 1)[1].split('"', 1)[0]
            values[label] = float(line.rsplit(" ", 1)[1])
    return values


def test_greedy_speculative_serving_equals_plain_decoding(server, tmp_path_factory, default_engines) -> None:  # type: ignore[no-untyped-def]
    pipeline = onnx_pipeline(tmp_path_factory, default_engines)
    conversations = [[TurnRequest(f"spec-{c}", text, new_session=t == 0, adapter=adapter, max_tokens=n,
                                  speculative=(c, t) != OPTED_OUT)
                      for t, (text, adapter, n) in enumerate(turns)] for c, turns in enumerate(CONVERSATIONS)]
    # plain: no drafter in process
    want = [[reference_reply(pipeline, r).token_ids for r in turns] for turns in conversations]
    got, errors = concurrent_token_ids(server.grpc_url, conversations)
    assert not errors
    assert got == want
    blocks, accepted = counter(server, "speculative_blocks"), counter(server, "speculative_accepted_tokens")
    assert sum(blocks.values()) > 0 and sum(accepted.values()) > 0, (blocks, accepted)
    assert set(accepted) <= {"base", "L0_chat", "L1_agent", "L2_code", "L3_design"}
