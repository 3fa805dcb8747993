"""Completions (issue 32): the tensor API's raw sessions, teacher forcing (`forced_ids`) and forks (`fork_from`), and
`POST /v1/completions` on them, driven by the real `openai` package against a real tritonserver.

The reference for teacher forcing is the in-process pipeline (tritonserver_backend/core/pipeline.py) on the same engine
backend (torch) and the same adapters: the server's forced log-probabilities must equal it bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ced.text.tokenizer import ChatTokenizer
from openai_frontend import completions as cmpl
from openai_frontend.errors import APIError
from tests.openai_frontend.conftest import EMBEDDED, encoded_tokens
from tritonserver_backend.clients.client import GrpcChat, HttpChat, TurnRequest, cancel_turn

PROMPT = "The quick brown fox jumps over the lazy dog"


# ---------------------------------------------------------------------------------------------- request parsing
def _parse(tokenizer: ChatTokenizer, **body) -> cmpl.CompletionRequest:  # type: ignore[no-untyped-def]
    return cmpl.CompletionRequest.parse(json.dumps({"model": "mol2", **body}).encode(), tokenizer)


def test_prompts_of_every_shape_are_token_ids(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tuple(tokenizer.encode(PROMPT))
    assert [p.ids for p in _parse(tokenizer, prompt=PROMPT).prompts] == [ids]
    assert [p.ids for p in _parse(tokenizer, prompt=[PROMPT, "x"]).prompts] == [ids, tuple(tokenizer.encode("x"))]
    assert [(p.text, p.ids) for p in _parse(tokenizer, prompt=list(ids)).prompts] == [(None, ids)]
    assert [p.ids for p in _parse(tokenizer, prompt=[[1, 2], [3]]).prompts] == [(1, 2), (3,)]
    assert _parse(tokenizer, prompt="x").body.max_tokens == 16, "OpenAI's default"


@pytest.mark.parametrize("body, param", [
    ({"suffix": "tail"}, "suffix"), ({"best_of": 2}, "best_of"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"bogus": 1}, "bogus"), ({"n": 0}, "n"), ({"logprobs": 21}, "logprobs"), ({"prompt": [[10**9]]}, "prompt"),
    ({"prompt": []}, "prompt"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_unsupported_or_bad_parameters_are_400s_naming_them(tokenizer, body, param) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as err:
        _parse(tokenizer, **{"prompt": "x", **body})
    assert err.value.status == 400 and err.value.param.startswith(param), err.value
    assert _parse(tokenizer, prompt="x", suffix="", best_of=1).body.n == 1, "values that ask for nothing pass"


def test_parameter_table_names_every_key_once() -> None:
    keys = [k for k, _, _ in cmpl.table_rows()]
    assert len(keys) == len(set(keys)) and {"prompt", "echo", "logprobs", "n", "suffix"} <= set(keys)


# ---------------------------------------------------------------------------------------------- the tensor API
@pytest.fixture(scope="module")
def reference(tmp_path_factory):  # type: ignore[no-untyped-def]
    import torch

    from tritonserver_backend.adapters.registry_init import ensure_registry
    from tritonserver_backend.core.pipeline import InProcessPipeline

    # the server's models run torch on one thread (torch_threads); a reduction's order follows it
    torch.set_num_threads(1)
    root = Path(tmp_path_factory.mktemp("completions-registry"))
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, backend="torch", max_context=2048)


def test_in_process_forks_and_forced_ids(reference, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The pipeline alone (no server): a prefill-only raw turn, forks of it with no new tokens reply like a session of
    their own (and encode nothing), forced ids come back as sent and then continue like the prefill path, a fork of a
    session that is gone is refused, and a fork's rollback leaves no trace."""
    from tritonserver_backend.core import counters as k
    from tritonserver_backend.errors import ServingError
    from tritonserver_backend.sampling.sampler import SamplingParams

    ids = tokenizer.encode(PROMPT)
    greedy = SamplingParams(max_tokens=5, raw=True)
    head = reference.chat("ip-src", PROMPT, "base", True, params=SamplingParams(max_tokens=0, raw=True))
    assert head.token_ids == [] and head.finish_reason == "length"
    encoded = reference.encoder.counters.get(k.ENCODED_TOKENS, k.TURN)
    forks = [reference.chat(f"ip-fork-{i}", "", "base", True, params=greedy, fork_from="ip-src", end_session=True)
             for i in range(2)]
    direct = reference.chat("ip-direct", PROMPT, "base", True, params=greedy, end_session=True)
    forced = reference.chat("ip-forced", "", "base", True,
                            params=SamplingParams(max_tokens=5, raw=True, forced_ids=tuple(ids)), end_session=True)
    assert [f.token_ids for f in forks] == [direct.token_ids] * 2 and forced.token_ids == ids + direct.token_ids
    assert reference.encoder.counters.get(k.ENCODED_TOKENS, k.TURN) == encoded + (len(ids) + 1) + 1, \
        ("forks encode nothing: the direct session <|bos|> + the prompt, the forced one <|bos|> (its prompt goes "
         "by steps)")
    reference.end("ip-src")
    with pytest.raises(ServingError):
        reference.chat("ip-late", "", "base", True, params=greedy, fork_from="ip-src")
    assert not reference.encoder.sessions.contains("ip-late") and "ip-late" not in reference.encoder._h19


def _grpc(triton, *requests: TurnRequest) -> list:  # type: ignore[no-untyped-def]
    chat = GrpcChat(triton.grpc_url)
    try:
        return [chat.turn(r) for r in requests]
    finally:
        chat.close()


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["L2_code", None])
def test_forced_ids_equal_the_in_process_teacher_forcing_bit_for_bit(triton, reference, tokenizer, adapter) -> None:  # type: ignore[no-untyped-def]
    """A raw session of <|bos|> alone with the prompt as forced_ids: the server emits every prompt token with its
    log-probability and top-3, then samples up to 4 more; gRPC streaming and HTTP /generate both equal the in-process
    pipeline's teacher forcing exactly (same engine backend, same adapters), and the forced ids come back as sent."""
    from tritonserver_backend.sampling.sampler import SamplingParams

    ids = tokenizer.encode(PROMPT)
    kw = dict(raw=True, forced_ids=ids, max_tokens=4, logprobs=True, top_logprobs=3, adapter=adapter, end_session=True,
              new_session=True)
    [streamed] = _grpc(triton, TurnRequest(f"forced-grpc-{adapter}", "", **kw))
    whole = HttpChat(triton.http_url).turn(TurnRequest(f"forced-http-{adapter}", "", stream=False, **kw))
    ref = reference.chat(f"forced-ref-{adapter}", "", adapter, True,
                         params=SamplingParams(max_tokens=4, logprobs=True, top_logprobs=3, raw=True,
                                               forced_ids=tuple(ids)),
                         end_session=True)
    for got in (streamed, whole):
        assert got.error is None, got.error
        # then up to 4 sampled tokens: the default may end the turn sooner (it does after this prompt, routed)
        assert got.token_ids == ref.token_ids and got.token_ids[:len(ids)] == ids
        assert len(ids) < len(got.token_ids) <= len(ids) + 4
        assert got.logprobs == [e.logprob for e in ref.logprobs], "bit for bit"
        assert got.top_token_ids == [list(e.top_ids) for e in ref.logprobs]
        assert got.top_logprobs == [list(e.top_logprobs) for e in ref.logprobs]
        assert got.adapter == ref.adapter and got.finish_reason == ref.finish_reason
        assert got.finish_reason == ("length" if len(got.token_ids) == len(ids) + 4 else "end_of_turn")
    assert all(lp <= 0 for lp in streamed.logprobs) and not math.isclose(sum(streamed.logprobs), 0.0)


@pytest.mark.slow
def test_a_fork_shares_the_prompts_prefill_and_equals_a_session_of_its_own(triton, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A raw prefill-only turn (max_tokens 0) holds the prompt; two forks of it encode nothing and reply exactly like
    a session that encoded the prompt itself; a stranger's fork (wrong fork_token) is refused; session_control "end"
    drops the idle source, after which forking it is refused too."""
    ids = tokenizer.encode(PROMPT)
    chat = GrpcChat(triton.grpc_url)
    try:
        before = encoded_tokens(triton)
        head = chat.turn(TurnRequest("fork-src", PROMPT, new_session=True, raw=True, max_tokens=0))
        assert head.error is None and head.token_ids == [] and head.finish_reason == "length" and head.session_token
        assert encoded_tokens(triton) - before == len(ids) + 1, "<|bos|> + the prompt, once"
        forks = [chat.turn(TurnRequest(f"fork-{i}", "", new_session=True, raw=True, fork_from="fork-src", max_tokens=6,
                                       end_session=True)) for i in range(2)]
        assert encoded_tokens(triton) - before == len(ids) + 1, "a fork re-encodes nothing"
        direct = chat.turn(TurnRequest("fork-direct", PROMPT, new_session=True, raw=True, max_tokens=6,
                                       end_session=True))
        assert all(f.error is None and f.token_ids == direct.token_ids and f.adapter == direct.adapter
                   for f in forks), (forks, direct)
        stranger = chat.turn(TurnRequest("fork-stranger", "", new_session=True, raw=True, fork_from="fork-src",
                                         fork_token="not-the-token", max_tokens=2))
        assert stranger.error and "session_token" in stranger.error
        ended = cancel_turn(triton.http_url, "fork-src", chat.tokens.get("fork-src"), action="end")
        assert ended["outcome"] == "ended"
        late = chat.turn(TurnRequest("fork-late", "", new_session=True, raw=True, fork_from="fork-src", max_tokens=2))
        assert late.error and ("ended" in late.error or "session_token" in late.error), late.error
    finally:
        chat.close()


# ---------------------------------------------------------------------------------------------- /v1/completions
def _merged(stream) -> dict:  # type: ignore[no-untyped-def]
    """Streamed text_completion chunks folded into {index: (text, tokens, token_logprobs, top_logprobs, finish)}."""
    out: dict[int, list] = {}
    for chunk in stream:
        for ch in chunk.choices:
            cur = out.setdefault(ch.index, ["", [], [], [], None])
            cur[0] += ch.text
            if ch.logprobs is not None:
                cur[1] += ch.logprobs.tokens
                cur[2] += ch.logprobs.token_logprobs
                cur[3] += ch.logprobs.top_logprobs
            cur[4] = ch.finish_reason or cur[4]
    return {i: tuple(v) for i, v in out.items()}


@pytest.mark.slow
def test_echo_with_logprobs_scores_the_prompt_streamed_and_not(client, triton, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """echo + logprobs: the prompt's tokens then the completion's, each with its log-probability (the first prompt
    token's is null, as OpenAI shows it) and its top-2; text_offset indexes the returned text; the figures equal the
    tensor API's forced decoding; streamed chunks add up to the same choice."""
    ids = tokenizer.encode(PROMPT)
    kwargs = dict(model="mol2:base", prompt=PROMPT, max_tokens=3, echo=True, logprobs=2, temperature=0)
    done = client.completions.create(**kwargs)
    [choice] = done.choices
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 3 and choice.finish_reason == "length"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(t) <= 2 and max(t.values()) >= x for t, x in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert [choice.text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 3
    [ref] = _grpc(triton,
                  TurnRequest("echo-ref", "", new_session=True, raw=True, forced_ids=ids, max_tokens=3, adapter="base",
                                     logprobs=True, top_logprobs=2, end_session=True))
    assert lp.token_logprobs[1:] == ref.logprobs[1:] and choice.text == "".join(ref.pieces)
    streamed = _merged(client.completions.create(**kwargs, stream=True))
    assert streamed == {0: (choice.text, lp.tokens, lp.token_logprobs, lp.top_logprobs, "length")}
    for model in ("mol2:base", "mol2"):  # a routed forced session runs under the adapter the prompt is routed to
        plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
        echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                           logprobs=0)
        assert plain.choices[0].logprobs is None and echoed.choices[0].text == PROMPT + plain.choices[0].text, model
        assert echoed.adapter == plain.adapter, model
    full = client.completions.create(model="mol2:base", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    stop = full.strip()[1:3]
    want = full[:full.index(stop)]
    # the prefill path (the server stops) and the forced one (the frontend)
    for extra in ({}, {"echo": True, "logprobs": 0}):
        cut = client.completions.create(model="mol2:base", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                        **extra).choices[0]
        assert cut.text == (PROMPT if extra else "") + want and cut.finish_reason == "stop", (
            extra, stop, full, cut.text)


@pytest.mark.slow
def test_n3_gives_three_choices_from_one_prefill(client, triton, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """n=3: the encoder encodes <|bos|> + the prompt once for all three choices (mol2_encoded_tokens{kind="turn"}),
    choice i is what n=1 with seed + i gives (which encodes the prompt itself), streamed equals non-streamed."""
    ids = tokenizer.encode(PROMPT)
    kwargs = dict(model="mol2", prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=11)
    before = encoded_tokens(triton)
    done = client.completions.create(**kwargs)
    assert encoded_tokens(triton) - before == len(ids) + 1, "one prefill for three choices"
    assert [c.index for c in done.choices] == [0, 1, 2] and done.usage.prompt_tokens == len(ids)
    assert 3 <= done.usage.completion_tokens <= 18
    single = [client.completions.create(model="mol2", prompt=PROMPT, max_tokens=6, temperature=1.0,
                                        seed=11 + i).choices[0].text
              for i in range(3)]
    assert [c.text for c in done.choices] == single
    assert len(set(single)) > 1, "different seeds, different samples"
    streamed = _merged(client.completions.create(**kwargs, stream=True))
    assert [streamed[i][0] for i in range(3)] == single
    scored = client.completions.create(model="mol2:base", prompt=PROMPT, max_tokens=2, n=2, echo=True, logprobs=1,
                                       temperature=0)
    a, b = (c.logprobs for c in scored.choices)
    assert a.token_logprobs == b.token_logprobs and a.tokens[:len(ids)] == b.tokens[:len(ids)], "greedy forks agree"


@pytest.mark.slow
def test_lm_evaluation_harness_loglikelihood_request(client, triton, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """What lm-eval's local-completions sends for loglikelihood (token-id prompts, echo, logprobs=1, max_tokens=1,
    temperature 0, seed) and how it reads the answer: sum(token_logprobs[ctxlen:-1]) and the greedy check on
    top_logprobs; the continuation's sum equals the tensor API's forced log-probabilities."""
    context, continuation = tokenizer.encode("The quick brown fox"), tokenizer.encode(" jumps over the lazy dog")
    prompts = [context + continuation, context + tokenizer.encode(" sleeps")]
    out = client.completions.create(model="mol2:base", prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                                    seed=1234, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    scores = []
    for choice, tokens in zip(sorted(out.choices, key=lambda c: c.index), prompts):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(tokens) + 1
        ctxlen = len(context)
        scores.append(sum(lp.token_logprobs[ctxlen:-1]))
        assert all(isinstance(t, dict) and len(t) == 1 for t in lp.top_logprobs[ctxlen:-1])
    [ref] = _grpc(triton,
                  TurnRequest("lm-eval-ref", "", new_session=True, raw=True, forced_ids=prompts[0], max_tokens=0,
                                     adapter="base", logprobs=True, end_session=True))
    assert scores[0] == pytest.approx(sum(ref.logprobs[len(context):]), abs=1e-9)


def test_the_docs_table_lists_every_completions_parameter() -> None:
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    section = text[text.index("## Completions"):]
    section = section[:section.index("\n## ", 3)]
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([a-z_]+)` \| ([^|]+) \|", section, re.M)}
    assert rows == {name: status for name, status, _ in cmpl.table_rows()}


@pytest.mark.slow
def test_chat_n3_gives_three_choices_from_one_prefill(client, triton, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Chat completions with n=3: the conversation is encoded once (a prefill-only session, then three forks), choice
    i is what n=1 with seed + i gives, logprobs come per choice, streamed equals non-streamed; tools with n > 1 are a
    400."""
    import openai

    messages = [{"role": "user", "content": "Hi! How was your day?"}, {"role": "assistant", "content": "fine"},
                {"role": "user", "content": "def mean(xs):"}]
    kwargs = dict(model="mol2", messages=messages, max_tokens=6, n=3, temperature=1.0, seed=5)
    before = encoded_tokens(triton)
    done = client.chat.completions.create(**kwargs, logprobs=True)
    encoded = encoded_tokens(triton) - before
    assert encoded == done.usage.prompt_tokens, "the conversation once, for three choices"
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(len(c.logprobs.content) == 6 for c in done.choices) and done.usage.completion_tokens == 18
    single = [client.chat.completions.create(model="mol2", messages=messages, max_tokens=6, temperature=1.0, seed=5 + i)
              .choices[0].message.content for i in range(3)]
    assert [c.message.content for c in done.choices] == single and len(set(single)) > 1
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert [streamed[i] for i in range(3)] == single
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**kwargs, tools=[{"type": "function", "function": {"name": "f"}}])
