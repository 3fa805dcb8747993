"""Requests in flight per API key (issue 63): one tenant cannot take every turn slot of the server. A key at its bound
gets 429 with Retry-After at once, another key is served meanwhile, and a streamed reply holds its key's slot until
its last event."""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator

import pytest
from fastapi.testclient import TestClient

from ced.text.tokenizer import ChatTokenizer
from openai_frontend.admission import KeyAdmission
from openai_frontend.app import create_app
from openai_frontend.prefix_cache import PrefixCache, namespace_of
from openai_frontend.service import ChatService
from openai_frontend.session_cost import SessionCost
from openai_frontend.triton_stream import Piece
from tests.waiting import wait_until
from tritonserver_backend.clients.client import TurnRequest

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


class HeldEnsemble:
    """A stand-in for the `mol2` ensemble whose turns for sessions named in `hold` stream until `release` is set."""

    url = "fake:0"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.streaming = threading.Event()

    async def turn(self, request: TurnRequest) -> AsyncIterator[Piece]:
        token = "tok" if request.new_session else ""
        yield Piece((7,), "first ", "L0_chat", "", session_token=token)
        if "hold" in request.text:
            self.streaming.set()
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        yield Piece((8,), "last", "L0_chat", "", session_token=token)
        yield Piece((), "", "L0_chat", "stop", session_token=token)

    async def adapters(self) -> list[str]:
        return ["L0_chat"]

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def _chat(http: TestClient, key: str, text: str, stream: bool = False):  # type: ignore[no-untyped-def]
    return http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                     json={"model": "mol2", "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                           "stream": stream})


def test_a_key_at_its_bound_is_refused_while_another_key_is_served(tokenizer: ChatTokenizer) -> None:
    fake = HeldEnsemble()
    service = ChatService(fake, tokenizer, PrefixCache(10**9, SessionCost(100, 10.0)))  # type: ignore[arg-type]
    app = create_app(service, [KEY_A, KEY_B], per_key_in_flight=1)
    http = TestClient(app)
    held: list = []
    streaming = threading.Thread(target=lambda: held.append(_chat(http, KEY_A, "hold the line", stream=True)))
    streaming.start()
    try:
        assert fake.streaming.wait(timeout=30), "the held turn never started streaming"
        refused = _chat(http, KEY_A, "another one")
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1", refused.text
        assert refused.json()["error"]["code"] == "key_busy"
        other = _chat(http, KEY_B, "a different tenant")
        assert other.status_code == 200, other.text
    finally:
        fake.release.set()
        streaming.join(timeout=30)
    assert held and held[0].status_code == 200 and "data: [DONE]" in held[0].text
    admission: KeyAdmission = app.state.admission
    wait_until(lambda: admission.held(namespace_of(KEY_A)) == 0, 10, "key A's slot given back after its stream")
    assert _chat(http, KEY_A, "now it fits").status_code == 200


def test_the_admission_count_never_goes_below_zero() -> None:
    admission = KeyAdmission(2)
    assert admission.acquire("a") and admission.acquire("a") and not admission.acquire("a")
    admission.release("a")
    admission.release("a")
    with pytest.raises(RuntimeError, match="released more often"):
        admission.release("a")
    unbounded = KeyAdmission(0)
    assert all(unbounded.acquire("a") for _ in range(1000))
