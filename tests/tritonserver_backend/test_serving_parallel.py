"""Tensor- and expert-parallel serving through a real tritonserver, on CPU.

Rendered with `tensor_parallel_size` 2 (and with `enable_expert_parallel` too), the encoder and the decoder models
each lead a group of two ranks (`engines.rank_group`): every step runs on both, each rank holding half of the role's
attention heads, vocabulary and expert slices (or half of the experts), with the all-reduces of DeepSeek's code in
between. The scripted multi-adapter conversation of the main job (`scripts/run_main.py`: routed turns, then an
explicit adapter), with one more switch, must come back with exactly the tokens of the single-rank torch engine in
process, and the decoder's LoRA must be applied from each rank's cut of the bank (a routed turn and the explicit one).
The repository's default `speculative auto` drafts with DSpark there: the ranks return the `draft_main` rows, the
leader drafts (its accepted-token counter must grow).
Source independence holds bit for bit at N ranks: after the same history, the next turn's log-probabilities do not
depend on the adapter the previous turn used.

A rank killed under the server: the next turn gets a clear error naming the rank and how it died, at once, not a
hang; the turn after that is served again by a restarted group, with the single-rank tokens. Stopping the server
leaves no rank behind.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.tritonserver_backend.streams import reference_reply, start_server
from tests.tritonserver_backend.test_serving_exactness import FIRST, SECOND, SOURCES, TARGET, assert_same, probe
from tests.tritonserver_backend.test_serving_speculative import counter
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.client import GrpcChat, TurnRequest
from tritonserver_backend.clients.scripted import CONVERSATION
from tritonserver_backend.core.pipeline import InProcessPipeline

pytestmark = pytest.mark.slow

EMBEDDED = Path(__file__).resolve().parents[2] / "embedded" / "mol2-small"
TOKENS = 20
TURNS = [TurnRequest("parallel", text, new_session=i == 0, adapter=adapter, max_tokens=TOKENS)
         for i, (adapter, text) in enumerate(CONVERSATION)]
TURNS.append(TurnRequest("parallel", "Now make it a CSS rule.", adapter="L3_design", max_tokens=TOKENS))
FORCED = [18, 308, 687, 356, 267, 1078, 20, 205]  # turn 1's reply in the source-independence test, whatever the adapter


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The in-process pipeline on the single-rank torch engine: the tokens a parallel server must reproduce."""
    root = tmp_path_factory.mktemp("single_rank_registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, max_context=2048)


@pytest.fixture(scope="module")
def single_rank_turns(single_rank) -> list:  # type: ignore[no-untyped-def]
    return [reference_reply(single_rank, r) for r in TURNS]


@pytest.fixture(scope="module", params=[False, True], ids=["tp2", "tp2-ep"])
def server(request, tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    srv = start_server(tmp_path_factory.mktemp("parallel"), default_engines, max_context="2048", engine_backend="torch",
                       tensor_parallel_size="2", enable_expert_parallel="true" if request.param else "false")
    try:
        yield srv
    finally:
        ranks = rank_workers(srv.pid)
        srv.stop()
    assert_exit(ranks, "a rank outlived its server")


def alive(pids: list[int]) -> list[int]:
    """The pids that still run (a zombie, exited but not yet reaped, counts as gone)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.append(pid)
    return running


def assert_exit(pids: list[int], message: str, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pids), f"{message}: pids {alive(pids)}"


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        chain.append(pid)
    return chain


def rank_workers(server_pid: int, role: str | None = None) -> list[int]:
    """Pids of the rank workers running under the process `server_pid` (of `role`, when given)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tritonserver_backend.engines.rank_worker" not in argv:
            continue
        if role is not None and argv[argv.index(b"--role") + 1].decode() != role:
            continue
        if server_pid in _ancestors(int(entry.name)):
            found.append(int(entry.name))
    return found


def _conversation(url: str, turns: list[TurnRequest]) -> list:
    chat = GrpcChat(url)
    try:
        return [chat.turn(r) for r in turns]
    finally:
        chat.close()


def test_the_scripted_conversation_gets_the_single_rank_tokens(server, single_rank_turns) -> None:  # type: ignore[no-untyped-def]
    got = _conversation(server.grpc_url, TURNS)
    assert [r.error for r in got] == [None] * len(TURNS)
    assert [r.adapter for r in got] == [r.adapter for r in single_rank_turns]
    assert {r.adapter for r in got} - {"base"}, "adapters applied on the ranks (not only the base model)"
    assert [r.token_ids for r in got] == [r.token_ids for r in single_rank_turns]
    assert len(rank_workers(server.pid, "encoder")) == 1 and len(rank_workers(server.pid, "decoder")) == 1
    # the repository's default `speculative auto` drafts with DSpark on the ranks (the leader runs the drafter graph);
    # the single-rank reference decodes plainly, so the equal tokens above are drafting's
    accepted = counter(server, "speculative_accepted_tokens")
    assert sum(accepted.values()) > 0, accepted


def test_source_independence_holds_bit_for_bit_on_the_ranks(server) -> None:  # type: ignore[no-untyped-def]
    """Turn 1 under each source adapter emits the same forced tokens, so every session holds the same history; turn 2
    under the target adapter (its bounded replay discards the source's rings) must then be the same bits in every
    log-probability whatever the source was. (Against a session rebuilt from the history, the torch engine is not
    bitwise even on one rank: its CPU matrix products round by chunk length, and a rebuilt session prefills in other
    chunks; measured 5-7 ulps of log-probability, the tokens equal. That comparison is the ONNX engines' property,
    tested in test_serving_exactness.py.)"""
    chat = GrpcChat(server.grpc_url)
    try:
        turns = {}
        for source in SOURCES:
            sid = f"parallel-source-{source}"
            first = chat.turn(TurnRequest(sid, FIRST, new_session=True, adapter=source, max_tokens=0,
                                          forced_ids=FORCED))
            assert first.error is None and first.token_ids == FORCED and first.adapter == source, first
            turns[source] = chat.turn(probe(SECOND, sid, TARGET))
    finally:
        chat.close()
    want = turns[SOURCES[0]]
    assert want.adapter == TARGET
    for source, got in turns.items():
        assert_same(got, want, f"after {source}")


def test_a_killed_rank_is_a_clear_error_and_the_group_restarts(server, single_rank_turns) -> None:  # type: ignore[no-untyped-def]
    _conversation(server.grpc_url, TURNS[:1])  # both groups running
    victims = rank_workers(server.pid, "decoder")
    assert len(victims) == 1
    os.kill(victims[0], signal.SIGKILL)
    started = time.monotonic()
    failed = _conversation(server.grpc_url,
                           [TurnRequest("parallel-killed", TURNS[0].text, new_session=True, max_tokens=TOKENS)])[0]
    assert time.monotonic() - started < 60, "a lost rank must not hang the turn"
    assert failed.error and "rank 1 of 2" in failed.error and "SIGKILL" in failed.error, failed.error
    again = _conversation(server.grpc_url,
                          [TurnRequest("parallel-again", TURNS[0].text, new_session=True, max_tokens=TOKENS)])[0]
    assert again.error is None and again.token_ids == single_rank_turns[0].token_ids
    restarted = rank_workers(server.pid, "decoder")
    assert len(restarted) == 1 and restarted != victims
