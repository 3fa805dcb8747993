"""`--api-key` and `/tokenize` / `/detokenize` on the real frontend process (no tritonserver needed for either: the
key is checked before any route runs, and tokenizing uses the model directory's own tokenizer)."""

from __future__ import annotations

import httpx
import openai
import pytest

from ced.text.tokenizer import ChatTokenizer, Message
from openai_frontend.process import FrontendProcess
from tests.conftest import EMBEDDED
from tests.waiting import wait_until
from tritonserver_backend.launcher import free_port

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):  # type: ignore[no-untyped-def]
    log = tmp_path_factory.mktemp("keyed-frontend") / "frontend.log"
    with FrontendProcess(f"127.0.0.1:{free_port()}", EMBEDDED, log_file=log, extra_args=["--api-key", KEY]) as proc:
        def answering() -> bool:
            try:
                return httpx.get(proc.base_url.removesuffix("/v1") + "/health", timeout=5).status_code == 503
            except httpx.TransportError:
                return False
        wait_until(answering, 60, "the frontend to answer (health is 503: no tritonserver behind it)")
        yield proc


def test_every_route_but_health_needs_the_key(keyed) -> None:  # type: ignore[no-untyped-def]
    root = keyed.base_url.removesuffix("/v1")
    for wrong in ("wrong", "", KEY + "x"):
        c = openai.OpenAI(base_url=keyed.base_url, api_key=wrong or "-", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as info:
            c.models.list()
        assert info.value.code == "invalid_api_key"
    assert httpx.post(f"{root}/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 401
    assert httpx.post(f"{keyed.base_url}/chat/completions", json={}, timeout=30).status_code == 401
    good = openai.OpenAI(base_url=keyed.base_url, api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.InternalServerError) as info:
        good.models.list()  # past the key check: the missing tritonserver is what answers
    assert info.value.status_code == 503


def test_tokenize_and_detokenize_follow_the_model_directorys_tokenizer(keyed) -> None:  # type: ignore[no-untyped-def]
    root, auth = keyed.base_url.removesuffix("/v1"), {"Authorization": f"Bearer {KEY}"}
    tok = ChatTokenizer.load(EMBEDDED)
    text = "def mean(xs): return sum(xs) / len(xs)"
    plain = httpx.post(f"{root}/tokenize", json={"model": "mol2", "prompt": text}, headers=auth, timeout=30).json()
    assert (plain["tokens"] == tok.encode(text) and plain["count"] == len(plain["tokens"])
            and plain["max_model_len"] == 8192)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    chat = httpx.post(f"{root}/tokenize", json={"messages": messages}, headers=auth, timeout=30).json()
    assert chat["tokens"] == tok.chat([Message("system", "be brief"), Message("user", text)])
    back = httpx.post(f"{root}/detokenize", json={"tokens": plain["tokens"]}, headers=auth, timeout=30).json()
    assert back["prompt"] == text
    for body, route in (({"prompt": "a", "messages": messages}, "tokenize"), ({}, "tokenize"),
                        ({"tokens": [tok.vocab_size]}, "detokenize"), ({"tokens": ["a"]}, "detokenize")):
        resp = httpx.post(f"{root}/{route}", json=body, headers=auth, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["message"], (route, body)
