"""Tools through the frontend, in process with the `openai` client against a stand-in for the `mol2` ensemble whose
reply is scripted text: what the server is sent (tools, the forcing grammar, tool results as the turn), the calls
parsed out of the reply (streamed chunks in OpenAI's shape, and not streamed), finish_reason "tool_calls", and the
conversation resent with the calls and their results continuing the same session. Against a real tritonserver (the
grammar really forcing the call): tests/openai_frontend/test_app.py."""

from __future__ import annotations

import json
import secrets
from typing import AsyncIterator

import openai
import pytest
from fastapi.testclient import TestClient

from ced.text.tokenizer import ChatTokenizer
from ced.text.tool_parsers import JsonTagSyntax, ToolCall
from openai_frontend.app import create_app
from openai_frontend.errors import APIError
from openai_frontend.prefix_cache import PrefixCache
from openai_frontend.schemas import ChatRequest
from openai_frontend.service import ChatService
from openai_frontend.session_cost import SessionCost
from openai_frontend.tool_calls import ToolReply, stream_deltas, wire
from openai_frontend.triton_stream import Piece
from tritonserver_backend.clients.client import TurnRequest

WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


class ScriptedEnsemble:
    """Sessions as the server keeps them (tokens, new_session), and a reply of scripted text in 5-character pieces."""

    url = "fake:0"

    def __init__(self) -> None:
        self.sessions: dict[str, str] = {}
        self.turns: list[TurnRequest] = []
        self.reply = "-color-color-color-"

    async def turn(self, request: TurnRequest) -> AsyncIterator[Piece]:
        self.turns.append(request)
        held = self.sessions.get(request.session_id)
        assert request.new_session or (held is not None and held == request.session_token)
        issued = ""
        if request.new_session:
            issued = self.sessions[request.session_id] = secrets.token_urlsafe(18)
        for k in range(0, len(self.reply), 5):
            yield Piece((7,), self.reply[k:k + 5], "L0_chat", "", session_token=issued)
        yield Piece((), "", "L0_chat", "end_of_turn", session_token=issued)

    async def adapters(self) -> list[str]:
        return ["L0_chat"]

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


@pytest.fixture
def setup(tokenizer):  # type: ignore[no-untyped-def]
    fake = ScriptedEnsemble()
    service = ChatService(fake, tokenizer, PrefixCache(10**9, SessionCost(100, 10.0)))  # type: ignore[arg-type]
    http = TestClient(create_app(service))
    return (openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0), fake,
            service)


def _stream(client, **kw):  # type: ignore[no-untyped-def]
    """A streamed completion accumulated as OpenAI's SDK users do: content, calls by index, finish_reason."""
    content, calls, finish, shapes = "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            shapes.append(tc.model_dump(exclude_none=True))
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish, shapes


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_parsed_into_tool_calls_and_the_conversation_continues(setup, stream: bool) -> None:  # type: ignore[no-untyped-def]
    client, fake, service = setup
    fake.reply = JsonTagSyntax().render([ToolCall("get_weather", '{"city": "Paris"}')])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="mol2", messages=messages, tools=[WEATHER, CLOCK], max_tokens=40,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        content, calls, finish, shapes = _stream(client, **kw)
        assert shapes[0]["id"] == calls[0]["id"] and shapes[0]["type"] == "function" and shapes[0]["function"] == {
            "name": "get_weather", "arguments": ""} and shapes[1] == {
                "index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    else:
        reply = client.chat.completions.create(**kw)
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        content = message.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert finish == "tool_calls" and not content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_") and len(calls[0]["id"]) == 29
    sent = fake.turns[-1]
    assert json.loads(sent.tools) == [WEATHER, CLOCK]
    assert sent.grammar["type"] == "ebnf" and sent.grammar["grammar"] == JsonTagSyntax().grammar([WEATHER])

    # the call's result, resent with the conversation, continues the same session: the result is the turn
    fake.reply = "It is sunny."
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": calls[0]["id"], "type": "function",
                      "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21 C"}]
    reply = client.chat.completions.create(model="mol2", messages=messages, tools=[WEATHER, CLOCK], max_tokens=40)
    assert reply.choices[0].message.content == "It is sunny." and reply.choices[0].finish_reason == "stop"
    assert not reply.choices[0].message.tool_calls
    follow = fake.turns[-1]
    assert (not follow.new_session and follow.session_id == sent.session_id and follow.text == ""
            and follow.grammar == auto_grammar([WEATHER, CLOCK]))
    assert json.loads(follow.turn_messages) == [{"role": "tool", "content": "sunny, 21 C",
                                                 "tool_call_id": calls[0]["id"]}]
    assert service.reused == 1
    # what the server renders for that turn is the conversation's next text
    chat_format = service.tokenizer.chat_format
    wires = [wire(m) for m in ChatRequest.parse(json.dumps({"model": "mol2", "messages": messages}).encode()).messages]
    assert chat_format.render(wires, tools=[WEATHER, CLOCK]).endswith(
        f'<|assistant|><tool_call>{{"name": "get_weather", "arguments": {calls[0]["arguments"]}}}</tool_call><|end|>'
        "<|user|><tool_result>sunny, 21 C</tool_result><|end|><|assistant|>")


def test_required_auto_and_none(setup) -> None:  # type: ignore[no-untyped-def]
    client, fake, service = setup
    messages = [{"role": "user", "content": "What time is it?"}]
    fake.reply = "Let me look. " + JsonTagSyntax().render([ToolCall("now", "{}"),
                                                           ToolCall("get_weather", '{"city": "Oslo"}')])
    reply = client.chat.completions.create(model="mol2", messages=messages, tools=[WEATHER, CLOCK],
                                           tool_choice="required")
    assert fake.turns[-1].grammar["grammar"] == JsonTagSyntax().grammar([WEATHER, CLOCK])
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["now"]  # a forced reply holds one call
    # auto: every call the model writes, after its text; parallel_tool_calls false: the first only
    for parallel, names in ((None, ["now", "get_weather"]), (False, ["now"])):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        reply = client.chat.completions.create(model="mol2", messages=messages, tools=[WEATHER, CLOCK], **extra)
        assert fake.turns[-1].grammar == auto_grammar([WEATHER, CLOCK], first_only=parallel is False)
        assert fake.turns[-1].tools is not None
        assert reply.choices[0].message.content == "Let me look. "
        assert [c.function.name for c in reply.choices[0].message.tool_calls] == names
        content, calls, finish, _ = _stream(client, model="mol2", messages=messages, tools=[WEATHER, CLOCK], **extra)
        assert content == "Let me look. " and [c["name"] for c in calls] == names and finish == "tool_calls"
    # auto with noise: plain content, finish "stop"
    fake.reply = "-color-color-<tool_call>{broken"
    for stream in (False, True):
        if stream:
            content, calls, finish, _ = _stream(client, model="mol2", messages=messages, tools=[WEATHER])
        else:
            reply = client.chat.completions.create(model="mol2", messages=messages, tools=[WEATHER])
            content, calls, finish = (reply.choices[0].message.content, reply.choices[0].message.tool_calls or [],
                                      reply.choices[0].finish_reason)
        assert (content, calls, finish) == (fake.reply, [], "stop")
    # none: the tools are not sent, the reply is not parsed
    fake.reply = JsonTagSyntax().render([ToolCall("now", "{}")])
    reply = client.chat.completions.create(model="mol2", messages=messages, tools=[WEATHER], tool_choice="none")
    assert fake.turns[-1].tools is None and reply.choices[0].message.content == fake.reply
    assert not reply.choices[0].message.tool_calls


def auto_grammar(tools: list[dict], first_only: bool = False) -> dict:
    return {"type": "structural_tag", "format": JsonTagSyntax().auto_format(tools, first_only)}


def test_auto_holds_a_begun_call_to_the_tools_unless_told_otherwise(setup, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """tool_choice auto sends a structural tag (text free, a begun call held to an offered tool and its schema); a
    response_format keeps its own grammar; a tool outside the forced-call schema subset leaves auto unconstrained; the
    frontend's --no-auto-tool-grammar sends none."""
    client, fake, _ = setup
    messages = [{"role": "user", "content": "What time is it?"}]
    client.chat.completions.create(model="mol2", messages=messages, tools=[WEATHER], tool_choice="auto")
    sent = fake.turns[-1].grammar
    assert sent["type"] == "structural_tag" and sent["format"]["triggers"] == ["<tool_call>"]
    assert [t["begin"] for t in sent["format"]["tags"]] == ['<tool_call>{"name": "get_weather", "arguments": ']
    assert sent["format"]["tags"][0]["content"]["json_schema"] == WEATHER["function"]["parameters"]
    client.chat.completions.create(model="mol2", messages=messages, tools=[WEATHER],
                                   response_format={"type": "json_object"})
    assert fake.turns[-1].grammar == {"type": "json_object"}
    patterned = {"type": "function", "function": {"name": "find", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": "^a"}}}}}
    client.chat.completions.create(model="mol2", messages=messages, tools=[patterned])
    assert fake.turns[-1].grammar is None
    plain = ChatService(fake, tokenizer, PrefixCache(10**9, SessionCost(100, 10.0)),  # type: ignore[arg-type]
                        constrain_auto_calls=False)
    other = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                          http_client=TestClient(create_app(plain)), max_retries=0)
    other.chat.completions.create(model="mol2", messages=messages, tools=[WEATHER])
    assert fake.turns[-1].grammar is None


def test_bad_tool_requests_are_400s(setup) -> None:  # type: ignore[no-untyped-def]
    client, fake, _ = setup
    messages = [{"role": "user", "content": "hi"}]
    sent = len(fake.turns)
    pattern = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^a+$"}}}}}
    for kw, word in [(dict(tools=[pattern], tool_choice="required"), "pattern"),
                     (dict(tools=[WEATHER, WEATHER]), "name of its own"),
                     (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice")]:
        with pytest.raises(openai.BadRequestError, match=word):
            client.chat.completions.create(model="mol2", messages=messages, **kw)
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model="mol2", messages=[*messages, {"role": "tool", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="JSON object"):
        client.chat.completions.create(model="mol2", messages=[
            *messages, {"role": "assistant",
                        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "x"}])
    assert len(fake.turns) == sent  # nothing reached the server


def test_request_turn_and_reply_pieces() -> None:
    body = {"model": "mol2", "messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "y", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "x", "content": "1"}, {"role": "tool", "tool_call_id": "y", "content": "2"}]}
    request = ChatRequest.parse(json.dumps(body).encode())
    assert [m[0] for m in request.turn] == ["tool", "tool"] and [m[0] for m in request.earlier] == ["user", "assistant"]
    assert wire(request.earlier[1])["tool_calls"][1] == {"id": "y", "type": "function",
                                                         "function": {"name": "g", "arguments": "{}"}}
    body["messages"].append({"role": "user", "content": "and?"})
    assert [m[0] for m in ChatRequest.parse(json.dumps(body).encode()).turn] == ["tool", "tool", "user"]
    body["messages"] = body["messages"][:1]
    assert ChatRequest.parse(json.dumps(body).encode()).turn == (("user", "a"),)
    with pytest.raises(APIError, match="last message"):
        ChatRequest.parse(json.dumps({"model": "mol2", "messages": [{"role": "assistant", "content": "x"}]}).encode())

    reply = ToolReply(JsonTagSyntax())
    text = "ok " + JsonTagSyntax().render([ToolCall("f", '{"a": 1}')])
    out = "".join(reply.feed(text[k:k + 3]) for k in range(0, len(text), 3)) + reply.feed("", final=True)
    assert out == reply.content == "ok " and [c.name for _, c in reply.calls] == ["f"]
    (index, call_id, call), = reply.take()
    assert reply.take() == [] and index == 0
    assert stream_deltas(index, call_id, call)[1] == {"tool_calls": [{"index": 0,
                                                                      "function": {"arguments": '{"a": 1}'}}]}


def test_a_deepseek_v41_model_directory_gets_dsml_calls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A model directory in DeepSeek-V4.1's format: the forcing grammar and the parser are DSML's, the call's result is
    rendered into the next user turn by the server's preprocess exactly as the whole conversation renders."""
    from ced.text.chat_format import DEEPSEEK_V41
    from ced.text.tool_parsers import DsmlSyntax
    from tests.ced.text.test_chat_format import BOS, DS_SPECIALS, EOS, _model_dir
    from tritonserver_backend.core.text_service import TextService

    folder = tmp_path / "deepseek"
    _model_dir(folder, DS_SPECIALS, {"bos_token": BOS, "eos_token": EOS, "chat_format": DEEPSEEK_V41})
    fake = ScriptedEnsemble()
    service = ChatService(fake, ChatTokenizer.load(folder), PrefixCache(10**9, SessionCost(100, 10.0)))  # type: ignore[arg-type]
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                           http_client=TestClient(create_app(service)), max_retries=0)
    fake.reply = DsmlSyntax().render([ToolCall("get_weather", '{"city": "Paris"}')])
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for stream in (False, True):
        kw = dict(model="mol2", messages=messages, tools=[WEATHER], tool_choice="required")
        if stream:
            content, calls, finish, _ = _stream(client, **kw)
        else:
            reply = client.chat.completions.create(**kw)
            content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in reply.choices[0].message.tool_calls]
        assert not content and finish == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"})]
        assert fake.turns[-1].grammar["grammar"] == DsmlSyntax().grammar([WEATHER])
    history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0]["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]}]
    results = [{"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]
    chat_format = service.tokenizer.chat_format
    ids, prefix, _ = TextService(folder).preprocess("", True, json.dumps(history), json.dumps([WEATHER]),
                                                    json.dumps(results))
    assert list(prefix) + list(ids) == chat_format.encode([*history, *results], tools=[WEATHER])
    assert chat_format.render([*history, *results], tools=[WEATHER]).endswith(
        f"{DsmlSyntax().render([ToolCall('get_weather', calls[0]['arguments'])])}{EOS}<｜User｜><tool_result>sunny"
        "</tool_result>"
        "<｜Assistant｜></think>")
