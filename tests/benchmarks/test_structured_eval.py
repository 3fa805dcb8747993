"""The structured-replies evaluation: its cases are held out from training, and its scoring counts only a reply that
ended by itself and is valid (a truncated or schema-breaking one is a miss)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion

from benchmarks.structured_eval import Case, canonical, cases, keys_as_asked, request, score, table, training_schemas
from build_engines.training.structured_data import held_out_tool

pytestmark = pytest.mark.slow  # the corpora and the training generator's schemas are made once per module (~5 s)


@pytest.fixture(scope="module")
def held_out(real_data: Path) -> list[Case]:
    return cases(Path(real_data), 6)


def test_cases_of_every_kind_none_seen_in_training(held_out: list[Case], real_data: Path) -> None:
    assert Counter(c.kind for c in held_out) == {k: 6 for k in ("json_schema", "json_object", "tool_forced",
                                                                 "tool_action", "tool_chat")}
    seen = training_schemas(Path(real_data))
    assert not any(canonical(c.schema) in seen for c in held_out if c.schema)
    names = {t["function"]["name"] for c in held_out for t in c.tools}
    assert names and all(held_out_tool(*n.split("_", 1)) for n in names)
    forced = [c for c in held_out if c.kind == "tool_forced"]
    assert all(request(c, 128)["tool_choice"] == {"type": "function", "function": {"name": c.tool}} for c in forced)


def reply(content: str | None, finish: str, calls: list[tuple[str, str]] = ()) -> ChatCompletion:  # type: ignore[assignment]
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                  "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]
    return ChatCompletion.model_validate({
        "id": "x", "object": "chat.completion", "created": 0, "model": "mol2",
        "choices": [{"index": 0, "finish_reason": finish, "message": message}]})


SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
          "required": ["tags"]}


def test_a_json_reply_counts_only_when_it_ended_and_is_valid() -> None:
    case = Case("json_schema", [], SCHEMA)
    assert score(case, reply('{"tags":["a","b"]}', "stop"))
    assert not score(case, reply('{"tags":["a","b"]}', "length"))  # cut by max_tokens, even if it parses
    assert not score(case, reply('{"tags":["a","b","c"]}', "stop"))  # maxItems broken
    assert not score(case, reply('{"tags":["a"', "stop"))
    assert score(Case("json_object", []), reply('{"x":1}', "stop"))
    assert not score(Case("json_object", []), reply("[1]", "stop"))


def test_tool_replies_are_scored_by_their_calls() -> None:
    tools = [{"type": "function", "function": {"name": "get_note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
    forced = Case("tool_forced", [], tools=tools, tool="get_note")
    assert score(forced, reply(None, "tool_calls", [("get_note", '{"text": "hi"}')]))
    assert not score(forced, reply(None, "tool_calls", [("get_note", '{"txt": "hi"}')]))  # required text missing
    assert not score(forced, reply(None, "tool_calls", [("other", '{"text": "hi"}')]))
    assert not score(forced, reply('<tool_call>{"name": "get_note", "arguments": {"text": "h', "length"))
    assert score(Case("tool_action", [], tools=tools), reply(None, "tool_calls", [("get_note", "{}")]))
    assert not score(Case("tool_action", [], tools=tools), reply("sure", "stop"))
    assert score(Case("tool_chat", [], tools=tools), reply("sure", "stop"))
    assert not score(Case("tool_chat", [], tools=tools), reply(None, "tool_calls", [("get_note", "{}")]))
    assert json.loads(json.dumps(request(Case("tool_chat", [], tools=tools), 128)))["tool_choice"] == "auto"


def test_json_object_keys_count_only_fields_the_request_named_each_once() -> None:
    case = Case("json_object", [], asked=("name", "tags"))
    assert keys_as_asked(case, reply('{"name":"a", "tags":["b"]}', "stop"))
    assert keys_as_asked(case, reply('{"tags":[]}', "stop"))
    assert not keys_as_asked(case, reply('{"name":"a", "city":"b"}', "stop"))  # a field nobody asked for
    assert not keys_as_asked(case, reply('{"name":"a", "name":"b"}', "stop"))  # parses, but a key twice
    assert not keys_as_asked(case, reply("{}", "stop"))
    assert not keys_as_asked(case, reply('{"name":"a"}', "length"))
    rows = [{"mode": "base", "kind": "json_object", "ok": True, "keys_ok": k} for k in (True, False, False, False)]
    assert table(rows)["base"] == {"json_object": 1.0, "json_object_keys": 0.25}


def test_json_object_cases_name_the_fields_of_their_json_schema_twin(held_out: list[Case]) -> None:
    schemas = [c for c in held_out if c.kind == "json_schema"]
    objects = [c for c in held_out if c.kind == "json_object"]
    assert [c.asked for c in objects] == [tuple(c.schema["properties"]) for c in schemas]
    assert all(all(k in c.messages[0]["content"] for k in c.asked) for c in objects)
