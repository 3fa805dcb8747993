"""No silent drops: every chat-completions parameter is honoured, accepted without effect, or refused with a 400 that
names it (openai_frontend/parameters.py), and docs/openai.md's table says the same."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from openai_frontend import parameters
from openai_frontend.errors import APIError
from openai_frontend.schemas import ChatRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai.md"


def _parse(**body) -> ChatRequest:  # type: ignore[no-untyped-def]
    return ChatRequest.parse(json.dumps({"model": "mol2", "messages": [{"role": "user", "content": "hi"}],
                                         **body}).encode())


@pytest.mark.parametrize("body,param", [
    (dict(response_format={"type": "xml"}), "response_format"),
    # one structured output at a time
    (dict(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex"),
    (dict(guided_json={"type": "object"}, ignore_eos=True), "guided_json"),  # a grammar decides where the reply ends
    (dict(logit_bias={"x": 5}), "logit_bias"),
    (dict(logit_bias={"42": 101}), "logit_bias"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(structured_outputs={"structural_tag": "x"}), "structured_outputs"),
    (dict(guided_decoding_backend="outlines"), "guided_decoding_backend"),
    (dict(best_of=2), "best_of"),
    (dict(tools=[{"type": "function", "function": {"nom": "f"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice"),  # a named function must be one of the tools
    (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
          response_format={"type": "json_object"}),
     "tool_choice"),  # a forced call is a grammar of its own
    (dict(tool_choice="required"), "tool_choice"),
    (dict(stop_token_ids="a"), "stop_token_ids"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(store=True), "store"),
    (dict(reasoning_effort="high"), "reasoning_effort"),
    (dict(foo_bar=1), "foo_bar"),
    (dict(temprature=0.5), "temprature"),  # a typo is not silently the default temperature
])
def test_a_parameter_the_server_would_drop_is_a_400_naming_it(body: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        _parse(**body)
    assert info.value.status == 400 and info.value.param == param and param in info.value.message


def test_every_offender_is_named_at_once() -> None:
    with pytest.raises(APIError) as info:
        _parse(best_of=2, use_beam_search=True, store=True)
    assert all(p in info.value.message for p in ("best_of", "use_beam_search", "store"))


@pytest.mark.parametrize("body", [
    dict(n=1, logprobs=False, top_logprobs=0, logit_bias={}, tools=[], tool_choice="none",
         response_format={"type": "text"},
         top_k=-1, min_p=0, stop_token_ids=[], ignore_eos=False, min_tokens=0, store=False, echo=False),
    dict(user="u-1", metadata={"k": "v"}, safety_identifier="s", prompt_cache_key="c", parallel_tool_calls=True),
    dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], tool_choice="auto"),
    dict(tools=[{"type": "function", "function": {"name": "f"}}],
         tool_choice={"type": "function", "function": {"name": "f"}}),
    dict(top_k=None, response_format=None, logprobs=None, tools=None),
    dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5, seed=1, top_p=0.9, temperature=0.7),
    dict(top_k=5, min_p=0.1, logit_bias={"42": 5, "7": -100}, stop_token_ids=[3], min_tokens=2, ignore_eos=True),
    dict(response_format={"type": "json_object"}, guided_decoding_backend="xgrammar"),
    dict(response_format={"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}),
    dict(guided_json='{"type": "object"}'), dict(guided_regex="[a-z]+"), dict(guided_grammar='root ::= "a"'),
    dict(guided_choice=["yes", "no"]), dict(structured_outputs={"json": {"type": "object"}}),
    dict(structured_outputs={"regex": "a+"}), dict(structured_outputs={"grammar": 'root ::= "a"'}),
    dict(structured_outputs={"choice": ["x"]}), dict(structured_outputs={"json_object": True}),
])
def test_values_that_ask_for_nothing_and_no_effect_fields_are_accepted(body: dict) -> None:
    assert _parse(**body).last == "hi"


def test_a_number_is_not_a_bool_that_asks_for_nothing() -> None:
    with pytest.raises(APIError):
        _parse(ignore_eos=0)  # a number where a bool is meant is not "asking for nothing"
    _parse(top_k=0)


def _doc_rows() -> dict[str, str]:
    text = DOC.read_text()
    section = text[text.index("## Parameters"):]
    section = section[:section.find("\n## ", 3)] if "\n## " in section[3:] else section
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([a-z_]+)` \| ([^|]+) \|", section, re.M)}


def test_the_docs_table_lists_every_parameter_with_its_status() -> None:
    rows = _doc_rows()
    want = {name: status for name, status, _ in parameters.table_rows()}
    assert rows == want, {k: (rows.get(k), want.get(k)) for k in set(rows) | set(want) if rows.get(k) != want.get(k)}


@pytest.mark.parametrize("body,grammar", [
    (dict(response_format={"type": "text"}), None),
    (dict(response_format={"type": "json_object"}), {"type": "json_object"}),
    (dict(response_format={"type": "json_schema",
                           "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True}}),
     {"type": "json_schema", "schema": {"type": "object"}}),
    (dict(guided_json='{"type": "integer"}'), {"type": "json_schema", "schema": {"type": "integer"}}),
    (dict(structured_outputs={"json": {"type": "integer"}}), {"type": "json_schema", "schema": {"type": "integer"}}),
    (dict(guided_regex="a+"), {"type": "regex", "pattern": "a+"}),
    (dict(structured_outputs={"grammar": 'root ::= "a"'}), {"type": "ebnf", "grammar": 'root ::= "a"'}),
    (dict(guided_choice=["yes", 'say "no"']), {"type": "ebnf", "grammar": 'root ::= "yes" | "say \\"no\\""'}),
])
def test_structured_outputs_become_the_tensor_apis_grammar(body: dict, grammar: dict | None) -> None:
    assert _parse(**body).grammar == grammar


def test_logit_bias_and_vllm_sampling_options_pass_through() -> None:
    request = _parse(logit_bias={"42": 5, "0007": -100}, top_k=3, min_p=0.05, stop_token_ids=[6, 9], min_tokens=2,
                     ignore_eos=True)
    assert request.logit_bias == {"42": 5.0, "7": -100.0}
    assert (request.top_k, request.min_p, request.stop_token_ids, request.min_tokens,
            request.ignore_eos) == (3, 0.05, (6, 9), 2, True)
