"""Request parsing: OpenAI fields into a ChatRequest, clear 400/404 errors for what cannot be served."""

from __future__ import annotations

import json

import pytest

from openai_frontend.errors import APIError, from_triton
from openai_frontend.schemas import ChatRequest


def _parse(**body) -> ChatRequest:  # type: ignore[no-untyped-def]
    return ChatRequest.parse(json.dumps({"model": "mol2", "messages": [{"role": "user", "content": "hi"}],
                                         **body}).encode())


def test_fields_map_onto_the_tensor_api() -> None:
    r = _parse(model="mol2:L2_code", max_completion_tokens=7, max_tokens=3, stop="END", temperature=0.5, seed=3,
               messages=[{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               stream=True, stream_options={"include_usage": True}, user="ignored")
    assert r.adapter == "L2_code" and r.max_tokens == 7 and r.stop == ("END",) and r.seed == 3
    assert (r.messages == (("system", "be brief"), ("user", "ab")) and r.earlier == (("system", "be brief"),)
            and r.last == "ab")
    assert r.stream and r.include_usage
    assert _parse().adapter is None and _parse(model="mol2:base").adapter == "base"


@pytest.mark.parametrize("body,status,param", [
    (dict(model="gpt-4o"), 404, "model"),
    (dict(n=17), 400, "n"),
    (dict(temperature=2.5), 400, "temperature"),
    (dict(top_p=0), 400, "top_p"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(frequency_penalty=3), 400, "frequency_penalty"),
    (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (dict(messages=[]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages.0.content.list[TextPart].0.type"),
    (dict(top_logprobs=3), 400, "top_logprobs"),  # needs logprobs: true
    (dict(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
])
def test_bad_bodies(body: dict, status: int, param: str) -> None:
    with pytest.raises(APIError) as info:
        _parse(**body)
    assert info.value.status == status and info.value.body()["error"]["message"]
    assert (info.value.param or "").startswith(param.split(".")[0])


def test_triton_messages_get_their_status() -> None:
    assert from_triton("server busy: 3 turns in flight (limit 3); retry shortly").status == 429
    assert from_triton("in ensemble 'mol2', unknown adapter 'x'; loaded adapters: []").status == 404
    assert from_triton("session 'oai-1' was evicted (session memory budget); resend").code == "session_lost"
    assert from_triton("max_tokens must lie in 1..4096, got 0").status == 400
    # a server the supervisor is restarting (the healing test saw this one once in CI): retry, not the client's fault
    draining = "in ensemble 'mol2', Server is stopping and has stopped accepting new inference requests"
    assert (from_triton(draining).status, from_triton(draining).code) == (503, "model_unavailable")
    assert from_triton("Stub process 'decoder_0_0' is not healthy.").status == 503
