"""Session tokens and API-key tenants in the frontend, in process against a stand-in for the `mol2` ensemble that
keeps the server's session rules (a token issued on the turn that starts a session, required by every later turn,
one refusal message from `session_auth`): the token travels with each continuing turn, a refused token rebuilds the
session under a new id, several API keys are each accepted and partition the prefix cache. The same against a real
tritonserver: tests/openai_frontend/test_app.py."""

from __future__ import annotations

import secrets
from typing import AsyncIterator

import pytest
from fastapi.testclient import TestClient

from ced.text.tokenizer import ChatTokenizer
from openai_frontend import app as app_module
from openai_frontend.app import create_app, key_checker
from openai_frontend.cli import api_keys, parser
from openai_frontend.errors import from_triton, session_lost, session_refused
from openai_frontend.prefix_cache import PrefixCache, namespace_of, prefix_key
from openai_frontend.service import ChatService
from openai_frontend.session_cost import SessionCost
from openai_frontend.triton_stream import Piece
from tritonserver_backend.auth.session_auth import refusal
from tritonserver_backend.clients.client import TurnRequest

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


class FakeEnsemble:
    """The session rules of the `mol2` ensemble with session_auth on, as the frontend meets them."""

    url = "fake:0"

    def __init__(self) -> None:
        self.sessions: dict[str, str] = {}  # live session id -> its token
        self.turns: list[TurnRequest] = []
        self.evicted: set[str] = set()

    async def turn(self, request: TurnRequest) -> AsyncIterator[Piece]:
        self.turns.append(request)
        sid, held = request.session_id, self.sessions.get(request.session_id)
        if sid in self.evicted and request.session_token == held:
            raise from_triton(f"session {sid!r} was evicted (session_budget_bytes); start it again with new_session")
        if held is not None and request.session_token != held:  # a live session: only its token opens it
            raise from_triton(str(refusal(sid)))
        if held is None and not request.new_session:
            raise from_triton(str(refusal(sid)))
        issued = ""
        if request.new_session:
            issued = self.sessions[sid] = secrets.token_urlsafe(18)
        yield Piece((7,), f"re: {request.text}", "L0_chat", "", session_token=issued)
        yield Piece((), "", "L0_chat", "stop", session_token=issued)

    async def adapters(self) -> list[str]:
        return ["L0_chat"]

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def _app(tokenizer: ChatTokenizer, keys: list[str] | None = None) -> tuple[TestClient, FakeEnsemble, ChatService]:
    fake = FakeEnsemble()
    service = ChatService(fake, tokenizer, PrefixCache(10**9, SessionCost(100, 10.0)))  # type: ignore[arg-type]
    return TestClient(create_app(service, keys)), fake, service


def _chat(http: TestClient, messages: list[dict], key: str | None = None):  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http.post("/v1/chat/completions", json={"model": "mol2", "messages": messages, "max_tokens": 4},
                     headers=headers)


def _metrics(http: TestClient) -> dict[str, float]:
    text = http.get("/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def _converse(http: TestClient, turns: list[str], key: str | None = None) -> tuple[list[dict], list]:  # type: ignore[type-arg]
    messages: list[dict] = []
    responses = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        resp = _chat(http, messages, key)
        assert resp.status_code == 200, resp.text
        responses.append(resp)
        messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
    return messages, responses


def test_the_refusal_message_is_a_lost_session() -> None:
    error = from_triton(f"in ensemble 'mol2', {refusal('oai-123')}")
    assert error.code == "session_refused" and session_refused(error) and session_lost(error)
    assert (not session_refused(from_triton("session 'x' was evicted"))
            and session_lost(from_triton("session 'x' was evicted")))


def test_a_continued_session_sends_the_token_its_first_reply_issued(tokenizer) -> None:  # type: ignore[no-untyped-def]
    http, fake, service = _app(tokenizer)
    _, responses = _converse(http, ["one", "two", "three"])
    assert [r.headers["x-mol2-session-reused"] for r in responses] == ["false", "true", "true"]
    first, *later = fake.turns
    assert first.new_session and first.session_token is None
    assert {t.session_id for t in fake.turns} == {first.session_id}
    assert [t.session_token for t in later] == [fake.sessions[first.session_id]] * 2
    assert service.refusals == 0 and service.reused == 2
    assert fake.sessions[first.session_id] not in repr(service.cache._entries), "the token is kept out of reprs (logs)"


def test_a_refused_token_rebuilds_the_session_under_a_new_id_and_is_counted(tokenizer) -> None:  # type: ignore[no-untyped-def]
    http, fake, service = _app(tokenizer)
    messages, _ = _converse(http, ["one"])
    old = fake.turns[0].session_id
    fake.sessions.clear()  # the server restarted: it knows neither the session nor its token
    messages.append({"role": "user", "content": "two"})
    resp = _chat(http, messages)
    assert resp.status_code == 200 and resp.headers["x-mol2-session-reused"] == "false", resp.text
    refused, rebuilt = fake.turns[1:]
    assert refused.session_id == old and not refused.new_session and refused.session_token
    assert rebuilt.session_id != old and rebuilt.new_session and rebuilt.history and rebuilt.session_token is None
    scraped = _metrics(http)
    assert scraped['mol2_frontend_session_token_refusals_total{path="openai"}'] == 1
    assert scraped['mol2_frontend_session_rebuilds_total{reason="token_refused"}'] == 1
    assert scraped['mol2_frontend_session_rebuilds_total{reason="session_lost"}'] == 0
    messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
    messages.append({"role": "user", "content": "three"})
    resp = _chat(http, messages)  # the rebuilt session, with its own new token
    assert resp.headers["x-mol2-session-reused"] == "true"
    assert (fake.turns[-1].session_id == rebuilt.session_id
            and fake.turns[-1].session_token == fake.sessions[rebuilt.session_id])
    assert service.refusals == 1 and service.rebuilt_after_refusal == 1


def test_an_evicted_session_is_rebuilt_and_counted_apart(tokenizer) -> None:  # type: ignore[no-untyped-def]
    http, fake, service = _app(tokenizer)
    messages, _ = _converse(http, ["one"])
    fake.evicted.add(fake.turns[0].session_id)
    messages.append({"role": "user", "content": "two"})
    assert _chat(http, messages).headers["x-mol2-session-reused"] == "false"
    scraped = _metrics(http)
    assert scraped['mol2_frontend_session_rebuilds_total{reason="session_lost"}'] == 1
    assert scraped['mol2_frontend_session_token_refusals_total{path="openai"}'] == 0


def test_each_api_key_is_accepted_and_a_wrong_one_is_401(tokenizer) -> None:  # type: ignore[no-untyped-def]
    http, _, _ = _app(tokenizer, [KEY_A, KEY_B])
    for key in (KEY_A, KEY_B):
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200, key
    for header in ({}, {"Authorization": "Bearer sk-tenant-c"}, {"Authorization": f"Bearer {KEY_A}x"},
                   {"Authorization": KEY_A}, {"Authorization": f"bearer {KEY_A}"}, {"Authorization": "Bearer "},
                   {"Authorization": f"Bearer {KEY_A},{KEY_B}"}):
        resp = http.get("/v1/models", headers=header)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", header
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200


def test_every_key_is_compared_whichever_matches(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """No early exit: the check compares the presented key with every configured key, in constant time each."""
    keys = [KEY_A, KEY_B, "sk-tenant-c"]
    check = key_checker(keys)
    calls: list[tuple[str, str]] = []
    real = app_module.hmac.compare_digest

    def counting(a, b):  # type: ignore[no-untyped-def]
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", counting)
    for presented, expected in ((KEY_A, namespace_of(KEY_A)), (KEY_B, namespace_of(KEY_B)), ("nope", None), ("", None)):
        calls.clear()
        assert check(f"Bearer {presented}") == expected
        assert len(calls) == len(keys), presented
    with pytest.raises(ValueError):
        key_checker([KEY_A, ""])


def test_the_same_messages_under_two_keys_never_share_a_session(tokenizer) -> None:  # type: ignore[no-untyped-def]
    http, fake, service = _app(tokenizer, [KEY_A, KEY_B])
    a_messages, _ = _converse(http, ["one", "two"], KEY_A)
    a_session = fake.turns[0].session_id
    a_messages.append({"role": "user", "content": "three"})
    stolen = _chat(http, a_messages, KEY_B)  # tenant B resends exactly tenant A's conversation
    assert stolen.status_code == 200 and stolen.headers["x-mol2-session-reused"] == "false"
    assert fake.turns[-1].session_id != a_session and fake.turns[-1].new_session, "B rebuilt a session of its own"
    assert all(t.session_id != a_session for t in fake.turns[2:])
    resp = _chat(http, a_messages, KEY_A)
    assert resp.headers["x-mol2-session-reused"] == "true", "A's own session is still A's to continue"
    assert fake.turns[-1].session_id == a_session and fake.turns[-1].session_token == fake.sessions[a_session]
    assert service.refusals == 0
    assert (prefix_key(a_messages, namespace_of(KEY_A)) != prefix_key(a_messages, namespace_of(KEY_B))
            != prefix_key(a_messages))
    assert prefix_key(a_messages) == prefix_key(a_messages, ""), "without keys: one namespace"


def test_without_keys_one_namespace_whatever_authorization_says(tokenizer) -> None:  # type: ignore[no-untyped-def]
    http, fake, _ = _app(tokenizer)
    messages, _ = _converse(http, ["one"], KEY_A)
    messages.append({"role": "user", "content": "two"})
    assert _chat(http, messages, KEY_B).headers["x-mol2-session-reused"] == "true"
    assert len({t.session_id for t in fake.turns}) == 1


def test_api_key_flag_repeats_and_the_environment_holds_a_list() -> None:
    p = parser()
    assert api_keys(p.parse_args(["--api-key", KEY_A, "--api-key", KEY_B]), {}) == [KEY_A, KEY_B]
    assert api_keys(p.parse_args(["--api-key", KEY_A]), {"MOL2_API_KEY": KEY_B}) == [KEY_A], "the flag wins"
    assert api_keys(p.parse_args([]), {"MOL2_API_KEY": f" {KEY_A}, {KEY_B},,{KEY_A}"}) == [KEY_A, KEY_B]
    assert api_keys(p.parse_args([]), {"MOL2_API_KEY": ""}) == [] == api_keys(p.parse_args([]), {})
    with pytest.raises(SystemExit):
        api_keys(p.parse_args(["--api-key", ""]), {})
