"""Tools and tool_choice through Dynamo's OpenAI frontend (issue 51), with a plain HTTP client.

The frontend renders the tools with our template, sends each tool_choice as a structural tag, and parses the reply
with hermes; the worker enforces the choice in the model's own call syntax (dynamo_deploy/tool_choice.py). So every
reply must be the reply of the single-server path's constraints on the same prompt, token for token, and forced calls
come back as `tool_calls` whose arguments validate against the tool's schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from dynamo_deploy.client import post_chat, stream_chat
from dynamo_deploy.launcher import read_turns
from tritonserver_backend.sampling.grammar import canonical
from tritonserver_backend.sampling.sampler import SamplingParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 64
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
           "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "utc": {"type": "boolean"}},
        "required": ["city", "utc"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = "What is the weather in Paris right now?"


@pytest.fixture(scope="module")
def deployment(dynamo_1x1):  # type: ignore[no-untyped-def]
    return dynamo_1x1  # tests/dynamo_deploy/conftest.py: shared with the other 1x1 modules


def _ask(deployment, tool_choice, **extra) -> tuple[dict, list[int]]:  # type: ignore[no-untyped-def]
    """One request offering TOOLS -> (the response's first choice, the tokens the decoder served for it)."""
    before = len(read_turns(deployment.run_dir))
    out = post_chat(deployment.url, {"model": "mol2-small", "messages": [{"role": "user", "content": ASK}],
                                 "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": MAX_TOKENS,
                                 "temperature": 0, **extra})
    turns = read_turns(deployment.run_dir)
    assert len(turns) == before + 1
    return out["choices"][0], turns[-1]["tokens"]


def _reference(reference, session: str, grammar: dict | None, tools: list | None = TOOLS) -> list[int]:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=MAX_TOKENS, grammar=canonical(json.dumps(grammar)) if grammar else "")
    return reference.chat(session, ASK, new_session=True, params=params,
                          tools=json.dumps(tools) if tools else None).token_ids


def _syntax(reference):  # type: ignore[no-untyped-def]
    from ced.text.tool_parsers import syntax_of

    return syntax_of(reference.text.tokenizer.chat_format)


def _valid_calls(choice: dict, names: set[str]) -> list[dict]:
    calls = choice["message"].get("tool_calls") or []
    for call in calls:
        assert call["type"] == "function" and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    return calls


def test_a_named_tool_choice_gives_that_call_as_the_single_server_writes_it(deployment, reference) -> None:  # type: ignore[no-untyped-def]
    choice, served = _ask(deployment, {"type": "function", "function": {"name": "get_time"}})
    assert [c["function"]["name"] for c in _valid_calls(choice, {"get_time"})] == ["get_time"]
    assert choice["finish_reason"] == "tool_calls"
    grammar = {"type": "ebnf", "grammar": _syntax(reference).grammar([TOOLS[1]])}
    assert served == _reference(reference, "ref-tools-named", grammar)


def test_required_gives_one_valid_call_of_an_offered_tool(deployment, reference) -> None:  # type: ignore[no-untyped-def]
    choice, served = _ask(deployment, "required")
    assert len(_valid_calls(choice, set(SCHEMAS))) == 1 and choice["finish_reason"] == "tool_calls"
    grammar = {"type": "ebnf", "grammar": _syntax(reference).grammar(TOOLS)}
    assert served == _reference(reference, "ref-tools-required", grammar)


def test_auto_and_none_follow_the_single_server_constraints(deployment, reference) -> None:  # type: ignore[no-untyped-def]
    _, served = _ask(deployment, "auto")
    fmt = _syntax(reference).auto_format(TOOLS, first_only=False)
    assert served == _reference(reference, "ref-tools-auto", {"type": "structural_tag", "format": fmt})
    _, served = _ask(deployment, "none")  # the tools are not rendered, nothing constrains the reply
    assert served == _reference(reference, "ref-tools-none", None, tools=None)


def test_a_streamed_named_call_arrives_whole_in_a_delta(deployment) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "mol2-small", "messages": [{"role": "user", "content": ASK}], "tools": TOOLS, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": MAX_TOKENS,
            "temperature": 0}
    calls, finish = [], None
    for event in stream_chat(deployment.url, body):
        for choice in event["choices"]:
            calls += choice.get("delta", {}).get("tool_calls") or []
            finish = choice.get("finish_reason") or finish
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and finish == "tool_calls"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER)
