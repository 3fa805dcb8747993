"""Dynamo's preprocessed sampling options reach our sampler: top_k / min_p / logit_bias / min_tokens / ignore_eos /
stop_token_ids and structured outputs (`guided_decoding`, from response_format), across the encoder -> decoder wire;
what the workers cannot serve (n > 1, a structural tag, two constraints) is refused with a 400, never dropped."""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import pytest

from dynamo_deploy.client import Conversation
from dynamo_deploy.requests import SPECULATIVE_OFF, params_from_json, params_to_json, sampling_params
from tests.conftest import EMBEDDED
from tritonserver_backend.errors import BadRequest
from tritonserver_backend.sampling.sampler import SamplingParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


def test_every_option_maps_and_crosses_the_wire_unchanged() -> None:
    request = {"sampling_options": {"temperature": 0.7, "top_k": 5, "min_p": 0.1, "seed": 3,
                                    "logit_bias": {"42": -100.0}, "guided_decoding": {"json": SCHEMA}},
               "stop_conditions": {"max_tokens": 9, "stop_token_ids": [7], "stop_token_ids_hidden": [6],
                                   "stop": ["zz"]}}
    p = sampling_params(request)
    assert ((p.top_k, p.min_p, p.logit_bias, p.stop_token_ids, p.seed, p.max_tokens)
            == (5, 0.1, ((42, -100.0),), (7,), 3, 9))
    assert json.loads(p.grammar) == {"type": "json_schema", "schema": SCHEMA}
    assert params_from_json(json.loads(json.dumps(params_to_json(p)))) == p, (
        "the decoder worker samples as the encoder read")
    plain = sampling_params({"stop_conditions": {"min_tokens": 2, "ignore_eos": True}})
    assert (plain.min_tokens, plain.ignore_eos, plain.grammar) == (2, True, "")
    choice = sampling_params({"sampling_options": {"guided_decoding": {"choice": ["yes", "no."]}}})
    assert json.loads(choice.grammar) == {"type": "regex", "pattern": "(yes|no\\.)"}
    assert (json.loads(sampling_params({"sampling_options": {"guided_decoding": {"json": {}}}}).grammar)
            == {"type": "json_object"})


@pytest.mark.parametrize("options,message", [
    ({"n": 17}, "n must lie in 1..16"),
    ({"n": 2, "best_of": 3}, "best_of is not served"),
    ({"guided_decoding": {"json": SCHEMA, "regex": "a+"}}, "one structured-output constraint at a time"),
    ({"guided_decoding": {"structural_tag": "{}"}}, "structural_tag"),
    ({"guided_decoding": {"grammar": ""}}, "needs \"grammar\""),
])
def test_what_cannot_be_served_is_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        sampling_params({"sampling_options": options})


def test_a_turn_opts_out_of_drafting_with_one_annotation_and_others_are_refused_by_name() -> None:
    assert sampling_params({}).speculative is True
    assert sampling_params({"annotations": [SPECULATIVE_OFF]}).speculative is False
    assert sampling_params({"annotations": ["mol2-session-token:x"]}).speculative is True
    with pytest.raises(BadRequest, match="mol2-speculative:off"):
        sampling_params({"annotations": ["mol2-speculative:on"]})


def _hermes_tag(names: list[str], at_least_one: bool) -> dict:
    """What Dynamo 1.6.1's frontend sends for a tool_choice with the hermes parser and its structural-tag policy on
    (recorded from a real frontend: tests/dynamo_deploy/test_tools.py runs it)."""
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": at_least_one, "stop_after_first": False,
        "tags": [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{n}", "arguments": ',
                  "content": {"type": "json_schema", "json_schema": SCHEMA, "style": "json"}, "end": "}\n</tool_call>"}
                 for n in names]}}


def test_a_tool_choice_tag_is_enforced_in_the_models_own_call_syntax() -> None:
    from ced.text.tokenizer import ChatTokenizer
    from ced.text.tool_parsers import syntax_of

    syntax = syntax_of(ChatTokenizer.load(EMBEDDED).chat_format)
    tools = [{"name": "plan", "parameters": SCHEMA}, {"name": "book", "parameters": SCHEMA}]
    forced = sampling_params({"sampling_options": {"guided_decoding": {"structural_tag": _hermes_tag(
        ["plan", "book"], True)}}}, syntax)
    assert json.loads(forced.grammar) == {"type": "ebnf", "grammar": syntax.grammar(tools)}
    auto = sampling_params({"sampling_options": {"guided_decoding": {"structural_tag": _hermes_tag(
        ["plan"], False)}}}, syntax)
    assert json.loads(auto.grammar) == {"type": "structural_tag", "format": syntax.auto_format(tools[:1], False)}
    assert "\\n" not in auto.grammar  # the default's syntax, not hermes's newlines (escaped in the JSON spec)
    own = {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}  # a client's own tag: as sent
    passed = sampling_params({"sampling_options": {"guided_decoding": {"structural_tag": own}}})
    assert json.loads(passed.grammar) == own
    with pytest.raises(BadRequest, match="cannot take tool_choice"):  # a model with no call syntax
        sampling_params({"sampling_options": {"guided_decoding": {"structural_tag": _hermes_tag(["plan"], True)}}})


@pytest.fixture(scope="module")
def deployment(dynamo_1x1):  # type: ignore[no-untyped-def]
    return dynamo_1x1  # tests/dynamo_deploy/conftest.py: shared with the other 1x1 modules


@pytest.mark.slow
def test_response_format_gives_schema_valid_json_and_refusals_are_400s(deployment) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(deployment.url, "structured")
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    reply = conv.say("Plan a short trip as JSON.", max_tokens=64, response_format=fmt)
    jsonschema.validate(json.loads(reply["text"]), SCHEMA)
    greedy = Conversation(deployment.url, "greedy").say("Name a colour.", max_tokens=8)
    top1 = Conversation(deployment.url, "top1").say("Name a colour.", max_tokens=8, top_k=1)
    assert top1["text"] == greedy["text"], "top_k=1 is greedy"



@pytest.mark.slow
def test_chat_logprobs_come_back_as_the_single_server_computes_them(deployment, reference) -> None:  # type: ignore[no-untyped-def]
    """logprobs / top_logprobs through the frontend: the decoder's log-softmax of the raw logits (the single-server
    path's), which the frontend serializes as float32."""
    body = {"model": "mol2-small", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
            "temperature": 0.0, "logprobs": True, "top_logprobs": 3}
    req = urllib.request.Request(f"{deployment.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        content = json.load(r)["choices"][0]["logprobs"]["content"]
    expected = reference.chat("ref-logprobs", "Name a colour.", new_session=True,
                              params=SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3))
    assert [e["token_id"] for e in content] == expected.token_ids
    for entry, lp in zip(content, expected.logprobs):
        assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-6)
        tokenizer = reference.text.tokenizer
        assert [t["token"] for t in entry["top_logprobs"]] == [tokenizer.decode([i], skip_special=False)
                                                               for i in lp.top_ids]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(list(lp.top_logprobs), abs=1e-6)


def test_echo_is_served_alone_and_with_several_choices() -> None:
    assert sampling_params({"output_options": {"prompt_logprobs": 1}}).max_tokens  # the worker serves echo
    assert sampling_params({"output_options": {"prompt_logprobs": 1}, "sampling_options": {"n": 2}}).max_tokens
    p = sampling_params({"output_options": {"logprobs": 3}})
    assert (p.logprobs, p.top_logprobs) == (True, 3)
    assert not sampling_params({"output_options": {"logprobs": None}}).logprobs
