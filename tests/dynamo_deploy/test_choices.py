"""`n` > 1 through Dynamo's frontend (issue 51): n choices of one prompt from one prefill, forked across the hand-over
(the encoder copies the prompt's state, the decoder its global-KV mirror and replay window). Choice i samples with
seed + i, so it must equal a single request with that seed, while the encoder encodes the prompt once for all n."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from dynamo_deploy.client import post_chat, stream_chat
from tritonserver_backend.core import counters as k

pytestmark = pytest.mark.slow
PROMPT = [{"role": "user", "content": "Hi there, how are you today?"}]


@pytest.fixture(scope="module")
def deployment(dynamo_1x1):  # type: ignore[no-untyped-def]
    return dynamo_1x1  # tests/dynamo_deploy/conftest.py: shared with the other 1x1 modules


def _encoded(deployment) -> float:  # type: ignore[no-untyped-def]
    """Tokens the encoders encoded for user turns (the `turn` label; `step` counts the replies fed back)."""
    return sum(w["counters"].get(f"{k.ENCODED_TOKENS}/turn", 0) for w in deployment.stats().values()
               if w["role"] == "encoder")


def _stored(deployment) -> float:  # type: ignore[no-untyped-def]
    """Sessions the decoders hold now (their `stored_sessions` gauge)."""
    return sum(w.get("gauges", {}).get("stored_sessions", 0) for w in deployment.stats().values()
               if w["role"] == "decoder")


def _settled(deployment, want: float, within_s: float = 10.0) -> float:  # type: ignore[no-untyped-def]
    """The decoders' stored sessions once they equal `want` (the gauge follows the scheduler's loop), or the last
    value seen after `within_s`."""
    deadline = time.monotonic() + within_s
    while (stored := _stored(deployment)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return stored


@pytest.mark.parametrize("adapter", [None, "L2_code"])
def test_n_choices_come_from_one_prefill_and_equal_single_requests(deployment, adapter) -> None:  # type: ignore[no-untyped-def]
    model = "mol2-small" if adapter is None else f"mol2-small:{adapter}"
    sampled = {"model": model, "messages": PROMPT, "max_tokens": 12, "temperature": 0.9, "top_p": 0.95}
    before, stored = _encoded(deployment), _stored(deployment)
    out = post_chat(deployment.url, {**sampled, "seed": 5, "n": 3})
    encoded = _encoded(deployment) - before
    # nothing of the request stays on the decoder: each choice ends with its turn, and the last one's fork ends the
    # prompt's session once copied
    assert _settled(deployment, stored) == stored
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert encoded == prompt_tokens  # the prompt once, for all three choices (a fork encodes nothing)
    texts = [c["message"]["content"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in sorted(out["choices"], key=lambda c: c["index"])] == [0, 1, 2]
    singles = [post_chat(deployment.url, {**sampled, "seed": 5 + i})["choices"][0]["message"]["content"]
               for i in range(3)]
    assert texts == singles
    assert len(set(texts)) > 1  # sampled: the seeds differ, so do the choices


def test_streamed_choices_are_tagged_by_index(deployment) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "mol2-small", "messages": PROMPT, "max_tokens": 6, "temperature": 0.9, "seed": 5, "n": 2,
            "stream": True}
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    for event in stream_chat(deployment.url, body):
        for c in event["choices"]:
            text[c["index"]] = text.get(c["index"], "") + ((c.get("delta") or {}).get("content") or "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    whole = post_chat(deployment.url, {**body, "stream": False})
    assert text == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert set(finish) == {0, 1}


def test_a_bad_n_is_refused_by_name(deployment) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "mol2-small", "messages": PROMPT, "max_tokens": 4, "temperature": 0.9, "n": 17}
    req = urllib.request.Request(f"{deployment.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=300)
    assert refused.value.code == 400 and "n must lie in 1..16" in refused.value.read().decode()
