"""Tools against a real tritonserver (the embedded default) with the `openai` client: tool_choice named and required,
streamed and not, force a call whose arguments validate against the tool's schema (the frontend's grammar really
constrains the decoder); auto gives words or calls that validate (a begun call is held to the tools); the call's
result, resent with the conversation, continues the same server session. In process with a scripted stand-in:
test_tool_calls.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
        "alerts": {"type": "boolean"}},
    "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {
    "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
MESSAGES = [{"role": "system", "content": "You can use tools."},
            {"role": "user", "content": "What is the weather in Paris?"}]


def _streamed(client, **kw):  # type: ignore[no-untyped-def]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def _whole(client, **kw):  # type: ignore[no-untyped-def]
    reply = client.chat.completions.create(**kw)
    message = reply.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
    return message.content or "", calls, reply.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_call_validates_against_its_schema(client, stream: bool, choice: str) -> None:  # type: ignore[no-untyped-def]
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    kw = dict(model="mol2", messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice=tool_choice, max_tokens=400,
              temperature=0)
    content, calls, finish = (_streamed if stream else _whole)(client, **kw)
    assert finish == "tool_calls" and content == "" and len(calls) == 1, (content, calls, finish)
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] in SCHEMAS
    if choice == "named":
        assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    # streamed and not, the same greedy call
    assert (_whole if stream else _streamed)(client, **kw)[1][0]["arguments"] == call["arguments"]


def test_auto_gives_words_or_valid_calls_and_results_continue_the_session(client) -> None:  # type: ignore[no-untyped-def]
    """tool_choice auto: whether to call is the model's choice; a call it begins is held to an offered tool and its
    schema (the structural tag), so the reply is plain content or calls that parse and validate, streamed or not."""
    for stream in (False, True):
        content, calls, finish = (_streamed if stream else _whole)(
            client, model="mol2", messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=48, temperature=0)
        if calls:
            assert finish == "tool_calls", (content, calls, finish)
            for call in calls:
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        else:
            assert finish in ("stop", "length") and content, (content, finish)
    # a forced call, its result resent with the conversation: the same session continues (cached tokens > 0)
    kw = dict(model="mol2", messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=400, temperature=0)
    first = client.chat.completions.with_raw_response.create(**kw)
    call = first.parse().choices[0].message.tool_calls[0]
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.with_raw_response.create(model="mol2", messages=messages, tools=[WEATHER],
                                                              max_tokens=8, temperature=0)
    assert second.headers["x-mol2-session-reused"] == "true", second.headers
    reply = second.parse()
    assert reply.usage.prompt_tokens_details.cached_tokens > 0 and reply.choices[0].finish_reason in (
        "stop", "length", "tool_calls")
