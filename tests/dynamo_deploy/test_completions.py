"""`/v1/completions` through Dynamo's frontend (issue 51): a prompt given as text or as token ids is a raw turn (the
text's ids as they are after <|bos|>, no template, no end-of-turn), as on the single-server path; logprobs come back
per token; n > 1 forks one prefill; echo is teacher forcing, as on the single-server path."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from dynamo_deploy.launcher import read_turns
from tritonserver_backend.sampling.sampler import SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "def mean(xs):\n    return"
TOKENS = 16


@pytest.fixture(scope="module")
def deployment(dynamo_1x1):  # type: ignore[no-untyped-def]
    return dynamo_1x1  # tests/dynamo_deploy/conftest.py: shared with the other 1x1 modules


def _complete(url: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _raw(reference, session: str, adapter: str | None = None, **params):  # type: ignore[no-untyped-def]
    return reference.chat(session, PROMPT, adapter=adapter, new_session=True, end_session=True,
                          params=SamplingParams(max_tokens=TOKENS, raw=True, **params))


@pytest.mark.parametrize("adapter", [None, "L2_code"])
def test_a_text_or_token_id_prompt_completes_as_the_single_server_does(deployment, reference, adapter) -> None:  # type: ignore[no-untyped-def]
    model = "mol2-small" if adapter is None else f"mol2-small:{adapter}"
    expected = _raw(reference, f"ref-raw-{adapter}", adapter)
    out = _complete(deployment.url, {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0})
    assert read_turns(deployment.run_dir)[-1]["tokens"] == expected.token_ids
    assert out["choices"][0]["text"] == expected.text
    ids = reference.text.tokenizer.encode(PROMPT)
    by_ids = _complete(deployment.url, {"model": model, "prompt": ids, "max_tokens": TOKENS, "temperature": 0})
    assert by_ids["choices"][0]["text"] == expected.text and by_ids["usage"]["prompt_tokens"] == len(ids)


def test_logprobs_and_n_choices(deployment, reference) -> None:  # type: ignore[no-untyped-def]
    out = _complete(deployment.url, {"model": "mol2-small", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                                     "logprobs": 2})
    expected = _raw(reference, "ref-raw-logprobs", logprobs=True, top_logprobs=2)
    assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx([lp.logprob for lp in expected.logprobs],
                                                                            abs=1e-6)
    sampled = {"model": "mol2-small", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.9}
    many = _complete(deployment.url, {**sampled, "seed": 3, "n": 2})
    texts = [c["text"] for c in sorted(many["choices"], key=lambda c: c["index"])]
    assert texts == [_complete(deployment.url, {**sampled, "seed": 3 + i})["choices"][0]["text"] for i in range(2)]


def test_echo_returns_the_prompt_with_its_logprobs_by_teacher_forcing(deployment, reference) -> None:  # type: ignore[no-untyped-def]
    """The single-server path's echo: the session starts from <|bos|> alone and the decoder emits the prompt by
    teacher forcing, each token with its log-probability, then samples; Dynamo's frontend returns it all as the
    choice's text and logprobs. The first prompt token's value is P(token | <|bos|>), where the project's OpenAI
    frontend shows null as OpenAI does."""
    ids = reference.text.tokenizer.encode(PROMPT)
    out = _complete(deployment.url, {"model": "mol2-small", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                     "echo": True, "logprobs": 1})
    expected = reference.chat("ref-echo", "", new_session=True, end_session=True,
                              params=SamplingParams(max_tokens=4, raw=True, forced_ids=tuple(ids), logprobs=True,
                                                    top_logprobs=1))
    assert expected.token_ids[:len(ids)] == ids
    choice = out["choices"][0]
    assert choice["text"] == reference.text.decode(expected.token_ids) and choice["text"].startswith(PROMPT)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-6)


def test_echo_with_several_choices_heads_each_with_the_forced_prompt(deployment, reference) -> None:  # type: ignore[no-untyped-def]
    """Echo with n > 1, as the project's OpenAI frontend serves it: the prompt is teacher-forced once in the prompt's
    own session (nothing sampled), its tokens and log-probabilities head every choice, and each choice samples in a
    fork of that session with seed + i; the in-process pipeline does the same turns."""
    ids = reference.text.tokenizer.encode(PROMPT)
    body = {"model": "mol2-small", "prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1, "n": 2,
            "temperature": 0.9, "seed": 21}
    out = sorted(_complete(deployment.url, body)["choices"], key=lambda c: c["index"])
    head = reference.chat("ref-echo-src", "", new_session=True,
                          params=SamplingParams(max_tokens=0, raw=True, forced_ids=tuple(ids), logprobs=True))
    assert head.token_ids == ids
    forks = [reference.chat(f"ref-echo-{j}", "", new_session=True, fork_from="ref-echo-src", end_session=True,
                            params=SamplingParams(max_tokens=3, raw=True, temperature=0.9, seed=21 + j,
                                                  logprobs=True))
             for j in range(2)]
    reference.end("ref-echo-src")
    assert [c["index"] for c in out] == [0, 1]
    for choice, fork in zip(out, forks):
        assert choice["text"] == reference.text.decode(ids + fork.token_ids) and choice["text"].startswith(PROMPT)
        want = [lp.logprob for lp in head.logprobs] + [lp.logprob for lp in fork.logprobs]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-6)
