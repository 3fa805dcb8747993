"""Session tokens on a real tritonserver (issue 34): a conversation belongs to the client that started it.

Over gRPC and HTTP: a stranger who knows a live session's id can neither continue, restart, rebuild, end nor cancel
it, and is told the same thing as for a session that does not exist; the owner's next reply is bit for bit the reply of
an undisturbed control session. Calls straight to the internal models (`encoder`, `decoder`), with a real hand-over
and grant obtained for the stranger's own session, are refused too. 32 concurrent sessions carrying their tokens get
their solo replies; with `session_auth` off the log says so and anyone continues any session.
"""

from __future__ import annotations

import json
import queue
import re
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.tritonserver_backend.streams import concurrent_token_ids, reference_reply, start_server
from tritonserver_backend import contract as c
from tritonserver_backend.auth.session_auth import REFUSAL
from tritonserver_backend.clients.client import GrpcChat, HttpChat, SessionTokens, TurnRequest, cancel_turn

pytestmark = pytest.mark.slow
TOKENS = 6
HISTORY = json.dumps([{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi there."}])


@pytest.fixture(scope="module")
def server(shared_server):  # type: ignore[no-untyped-def]
    return shared_server()  # conftest.py: the 4096-token server, shared with the prefix-cache module


def _chat(server, transport: str, tokens: SessionTokens | None = None):  # type: ignore[no-untyped-def]
    return GrpcChat(server.grpc_url, tokens) if transport == "grpc" else HttpChat(server.http_url, tokens)


def _refusals(server) -> dict[str, float]:  # type: ignore[no-untyped-def]
    found = {}
    for line in urllib.request.urlopen(server.metrics_url).read().decode().splitlines():
        match = re.match(r'mol2_session_token_refusals\{path="(\w+)"\} (\S+)', line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def _generic(message: str | None, session_id: str) -> str:
    """A refusal with the session id taken out (Triton prefixes the ensemble's name)."""
    assert message is not None
    return message.replace(repr(session_id), repr("ID"))


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_stranger_is_refused_everything_and_the_owner_continues_undisturbed(server, transport: str) -> None:  # type: ignore[no-untyped-def]
    owner, control, stranger = _chat(server, transport), _chat(server, transport), _chat(server, transport)
    sid, cid = f"alice-{transport}", f"control-{transport}"
    first = dict(new_session=True, max_tokens=TOKENS, logprobs=True)
    mine = owner.turn(TurnRequest(sid, "My bank PIN is 4921.", **first))
    theirs = control.turn(TurnRequest(cid, "My bank PIN is 4921.", **first))
    assert mine.error is None and theirs.error is None
    assert len(mine.session_token) >= 22 and mine.session_token != theirs.session_token, "each session its own token"
    assert mine.token_ids == theirs.token_ids

    before = _refusals(server)
    attempts = {  # what a stranger who knows the id might send
        "continue": TurnRequest(sid, "What was my PIN?", max_tokens=TOKENS),
        "wrong token": TurnRequest(sid, "What was my PIN?", max_tokens=TOKENS, session_token=theirs.session_token),
        "reset": TurnRequest(sid, "Forget it.", new_session=True, max_tokens=TOKENS),
        "rebuild over it": TurnRequest(sid, "Forget it.", history=HISTORY, max_tokens=TOKENS),
        "end": TurnRequest(sid, "Bye.", end_session=True, max_tokens=TOKENS),
    }
    messages = {}
    for what, request in attempts.items():
        reply = stranger.turn(request)
        assert reply.error is not None and not reply.token_ids, f"{what}: {reply}"
        messages[what] = _generic(reply.error, sid)
    nobody = stranger.turn(TurnRequest(f"nobody-{transport}", "Hello?", max_tokens=TOKENS))
    messages["unknown session"] = _generic(nobody.error, f"nobody-{transport}")
    assert len(set(messages.values())) == 1, messages  # one message: a stranger cannot tell a live session from none
    assert REFUSAL.format(session_id="ID").split(":")[0] in next(iter(messages.values()))
    for token in (None, "wrong"):
        with pytest.raises(RuntimeError) as refused:
            cancel_turn(server.http_url, sid, token)
        assert _generic(str(refused.value), sid).endswith(REFUSAL.format(session_id="ID"))
    after = _refusals(server)
    assert after["turn"] - before.get("turn", 0) == len(attempts) + 1  # the unknown session's turn is counted too
    assert after["cancel"] - before.get("cancel", 0) == 2

    second = dict(max_tokens=TOKENS, logprobs=True, top_logprobs=3)
    mine = owner.turn(TurnRequest(sid, "What was my PIN?", **second))
    theirs = control.turn(TurnRequest(cid, "What was my PIN?", **second))
    assert mine.error is None and mine.session_token == "", "a continuing turn issues nothing"
    assert ((mine.token_ids, mine.logprobs, mine.top_logprobs)
            == (theirs.token_ids, theirs.logprobs, theirs.top_logprobs)), \
        "the owner's reply is the undisturbed one, bit for bit"
    assert cancel_turn(server.http_url, sid, owner.tokens.get(sid))["outcome"] == "no turn in flight"

    old = owner.tokens.get(sid)
    assert owner.turn(TurnRequest(sid, "Bye.", end_session=True, max_tokens=2)).error is None
    ended = owner.turn(TurnRequest(sid, "Hello?", max_tokens=2))
    assert ended.error is not None and f"session {sid!r} was ended" in ended.error, "the owner learns why"
    rebuilt = stranger.turn(TurnRequest(sid, "Hello?", history=HISTORY, max_tokens=2))  # the id is free again
    assert rebuilt.error is None and rebuilt.session_token not in ("", old), "a rebuilt session gets a fresh token"
    for chat in (owner, control, stranger):
        if transport == "grpc":
            chat.close()


def _stream(url: str, model: str, tensors: dict[str, tuple[np.ndarray, str]]) -> tuple[list, str | None]:
    """One request to a decoupled model over a gRPC stream -> (responses, first error)."""
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    for name, (array, dtype) in tensors.items():
        inp = grpcclient.InferInput(name, list(array.shape), dtype)
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    responses: list = []
    error = None
    while True:
        result, error = results.get(timeout=120)
        if error is not None:
            break
        responses.append(result)
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
    client.stop_stream()
    client.close()
    return responses, None if error is None else str(error)


def _text(value: str) -> tuple[np.ndarray, str]:
    return np.array([value.encode()], dtype=np.object_), "BYTES"


def test_direct_calls_to_the_internal_models_cannot_touch_a_session(server) -> None:  # type: ignore[no-untyped-def]
    """A client may call `encoder` and `decoder` directly: without the server's internal key it cannot drop, step or
    cancel, and a real hand-over with a real grant, obtained from the encoder for its own session, opens no other
    session and cannot be used twice."""
    owner, control = GrpcChat(server.grpc_url), GrpcChat(server.grpc_url)
    request = dict(new_session=True, max_tokens=TOKENS)
    assert owner.turn(TurnRequest("bob-direct", "Plan my week.", **request)).error is None
    assert control.turn(TurnRequest("bob-control", "Plan my week.", **request)).error is None

    http = httpclient.InferenceServerClient(server.http_url)
    empty = np.zeros(0, np.int64)

    def encoder(**extra: tuple[np.ndarray, str]) -> httpclient.InferResult:
        tensors = {c.SESSION_ID.name: _text("bob-direct"), c.TOKEN_IDS.name: (empty, "INT64"),
                   c.PREFIX_IDS.name: (empty, "INT64"), c.START.name: (np.array([False]), "BOOL"), **extra}
        inputs = []
        for name, (array, dtype) in tensors.items():
            inp = httpclient.InferInput(name, list(array.shape), dtype)
            inp.set_data_from_numpy(array)
            inputs.append(inp)
        return http.infer("encoder", inputs)

    for extra in ({c.DROP_SESSION.name: (np.array([True]), "BOOL")},
                  {c.ROLLBACK.name: (np.array([True]), "BOOL")},
                  {c.DROP_SESSION.name: (np.array([True]), "BOOL"), c.INTERNAL_KEY.name: _text("x" * 43)},
                  {c.STEP_SESSION_IDS.name: (np.array([b"bob-direct"], dtype=np.object_), "BYTES"),
                   c.STEP_TOKEN_IDS.name: (np.array([[5]], np.int64), "INT64")},
                  {c.STEP_KEEP.name: (np.array([1], np.int64), "INT64")},  # never silently ignored on a user turn
                  {c.STEP_DRAFT.name: (np.array([True]), "BOOL")}):
        with pytest.raises(Exception, match="sent by the decoder only"):
            encoder(**extra)
    _, error = _stream(server.grpc_url, "decoder",
                       {c.SESSION_ID.name: _text("bob-direct"), c.CONTROL.name: _text("cancel")})
    assert error is not None and "sent by session_control only" in error

    # the stranger's own session, encoded by calling the encoder directly: a genuine hand-over and grant
    ids = np.array([7, 8, 9, 10], np.int64)
    mine = http.infer("encoder", [_input(c.SESSION_ID.name, _text("mallory")), _input(c.TOKEN_IDS.name, (ids, "INT64")),
                                  _input(c.PREFIX_IDS.name, (np.array([1], np.int64), "INT64")),
                                  _input(c.START.name, (np.array([True]), "BOOL"))])
    handover = {spec.name: (mine.as_numpy(spec.name), spec.dtype) for spec in c.HANDOVER}
    grant = _text(mine.as_numpy(c.GRANT.name).reshape(-1)[0].decode())
    turn = {**handover, c.ADAPTER_HASH.name: (np.array([0], np.int32), "INT32"),
            c.MAX_TOKENS.name: (np.array([2], np.int32), "INT32"), c.GRANT.name: grant}
    _, error = _stream(server.grpc_url, "decoder", {c.SESSION_ID.name: _text("bob-direct"), **turn})
    assert error is not None and REFUSAL.format(session_id="bob-direct") in error, "a grant opens its own session only"
    responses, error = _stream(server.grpc_url, "decoder", {c.SESSION_ID.name: _text("mallory"), **turn})
    assert error is None and responses, "the grant is good for its own session's turn"
    _, error = _stream(server.grpc_url, "decoder", {c.SESSION_ID.name: _text("mallory"), **turn})
    assert error is not None and "no live session 'mallory'" in error, "and only once"
    http.close()

    mine = owner.turn(TurnRequest("bob-direct", "And next week?", max_tokens=TOKENS, logprobs=True))
    theirs = control.turn(TurnRequest("bob-control", "And next week?", max_tokens=TOKENS, logprobs=True))
    assert mine.error is None and (mine.token_ids, mine.logprobs) == (theirs.token_ids, theirs.logprobs)
    owner.close()
    control.close()


def _input(name: str, value: tuple[np.ndarray, str]) -> httpclient.InferInput:
    inp = httpclient.InferInput(name, list(value[0].shape), value[1])
    inp.set_data_from_numpy(value[0])
    return inp


def test_thirty_two_sessions_carrying_their_tokens_get_their_solo_replies(server, tmp_path, default_engines) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import EMBEDDED
    from tritonserver_backend.adapters.registry_init import ensure_registry
    from tritonserver_backend.core.pipeline import InProcessPipeline

    ensure_registry(tmp_path / "registry", EMBEDDED)
    reference = InProcessPipeline(EMBEDDED, tmp_path / "registry", max_context=4096, backend="onnx",
                                  engine_dir=default_engines)
    adapters = ["L0_chat", "L1_agent", "L2_code", "L3_design", None, "base", None, "L2_code"] * 4
    conversations = [[TurnRequest(f"load{i}", f"Request {i}: {'sort a list' if i % 2 else 'center a div'}",
                                  new_session=True, adapter=a, max_tokens=3 + i % 4),
                      TurnRequest(f"load{i}", "And then?", adapter=None if i % 3 else a, max_tokens=4)]
                     for i, a in enumerate(adapters)]
    solo = [[reference_reply(reference, r).token_ids for r in turns] for turns in conversations]
    results, errors = concurrent_token_ids(server.grpc_url, conversations)
    assert not errors, errors[:3]
    assert results == solo


@pytest.fixture(scope="module")
def open_server(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    srv = start_server(tmp_path_factory.mktemp("open"), default_engines, session_auth="false")
    try:
        yield srv
    finally:
        srv.stop()


def test_session_auth_off_is_logged_and_lets_anyone_continue(open_server) -> None:  # type: ignore[no-untyped-def]
    log = open_server.log_file.read_text(errors="replace")
    assert "session_auth is OFF" in log and "trusted single-tenant" in log
    first = GrpcChat(open_server.grpc_url).turn(TurnRequest("shared", "Hello.", new_session=True, max_tokens=2))
    assert first.error is None and first.session_token == ""
    other = HttpChat(open_server.http_url).turn(TurnRequest("shared", "Hello again.", max_tokens=2))
    assert other.error is None and other.token_ids
