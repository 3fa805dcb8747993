"""Tool calls parsed back out of replies, in the syntax each chat format renders (the renderer is the spec), whole and
streamed, and the grammars that force one call (walked at random with xgrammar, every walk a call that validates)."""

from __future__ import annotations

import json
import random
import string

import jsonschema
import pytest
import xgrammar as xgr
import xgrammar.testing as xgr_testing

from ced.text.chat_format import DeepSeekV41Format
from ced.text.tokenizer import ChatTokenizer
from ced.text.tool_parsers import (
    DsmlSyntax,
    JsonTagSyntax,
    ToolCall,
    ToolCallStream,
    ToolSchemaError,
    syntax_of,
)
from tests.conftest import EMBEDDED

DS = DeepSeekV41Format()
CALL_SETS = [
    [ToolCall("get_weather", '{"city": "Paris"}')],
    [ToolCall("get_weather", '{"city": "Paris", "days": 2}'), ToolCall("lookup", '{"q": "é漢字🙂 <b>", "n": null}')],
    [ToolCall("noop", "{}")],
    [ToolCall("deep", '{"a": {"b": [1, 2.5, true, false, null, "x"]}, "s": "line\\nbreak \\"quoted\\"", "e": ""}')],
]


class _DeepSeek:
    """The built-in DeepSeek-V4.1 renderer with ChatFormat's render signature (no tokenizer needed for text)."""

    def render(self, messages: list, add_generation_prompt: bool = True, tools: list | None = None) -> str:
        return DS.render(messages, add_generation_prompt, None, tools, {})


@pytest.fixture(scope="module")
def default_format():  # type: ignore[no-untyped-def]
    return ChatTokenizer.load(EMBEDDED).chat_format


def _assistant(calls: list[ToolCall], content: str | None) -> list[dict]:
    wire = [{"id": f"call_{i}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]
    return [{"role": "user", "content": "?"}, {"role": "assistant", "content": content, "tool_calls": wire}]


def _same(got: list[ToolCall], want: list[ToolCall]) -> bool:
    return [(c.name, json.loads(c.arguments)) for c in got] == [(c.name, json.loads(c.arguments)) for c in want]


def test_each_format_selects_its_syntax(default_format) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(syntax_of(default_format), JsonTagSyntax)
    assert isinstance(syntax_of(_DeepSeek()), DsmlSyntax)

    class NoTools:
        def render(self, messages: list, add_generation_prompt: bool = True) -> str:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    assert syntax_of(NoTools()) is None


@pytest.mark.parametrize("calls", CALL_SETS)
@pytest.mark.parametrize("content", [None, "", "Let me check that."])
def test_round_trip_through_each_renderer(default_format, calls: list[ToolCall], content: str | None) -> None:  # type: ignore[no-untyped-def]
    """What the chat format renders for an assistant's calls parses back into those calls and its text."""
    text = default_format.render(_assistant(calls, content), add_generation_prompt=False)
    reply = text.split("<|assistant|>", 1)[1].removesuffix("<|end|>")
    assert JsonTagSyntax().parse(reply) == (content or "", calls)  # arguments exactly as the client sent them
    assert JsonTagSyntax().render(calls) == reply.removeprefix(content or "")

    text = _DeepSeek().render(_assistant(calls, content), add_generation_prompt=False)
    reply = text.split("</think>", 1)[1].removesuffix(DS.EOS)
    got_content, got = DsmlSyntax().parse(reply)
    assert got_content == (content or "") and _same(got, calls)
    assert DsmlSyntax().render(calls) == reply.removeprefix(content or "")


@pytest.mark.parametrize("syntax", [JsonTagSyntax(), DsmlSyntax()], ids=lambda s: s.name)
def test_streamed_in_any_pieces_equals_whole(syntax) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(3)
    for calls in CALL_SETS:
        for before, after in (("", ""), ("Sure. ", ""), ("a < b <tool", " trailing")):
            reply = before + syntax.render(calls) + after
            whole = syntax.parse(reply)
            assert whole[1] == calls or _same(whole[1], calls)
            for _ in range(20):
                stream, events, pos = ToolCallStream(syntax), [], 0
                while pos < len(reply):
                    n = rng.randint(1, 7)
                    events += stream.feed(reply[pos:pos + n])
                    pos += n
                events += stream.finish()
                assert "".join(e for e in events if isinstance(e, str)) == whole[0]
                assert [e for e in events if isinstance(e, ToolCall)] == whole[1]
            # nothing that may still open a call is streamed as content before it is known
            stream = ToolCallStream(syntax)
            first = stream.feed(before + syntax.render(calls)[:len(syntax.lead) + 3])
            assert "".join(e for e in first if isinstance(e, str)) == (before.rstrip() if syntax.lead else before)


@pytest.mark.parametrize("syntax", [JsonTagSyntax(), DsmlSyntax()], ids=lambda s: s.name)
def test_text_without_calls_and_malformed_calls_stay_content(syntax) -> None:  # type: ignore[no-untyped-def]
    noise = ["-color-color-color-", ".py.py.py", "<", "<tool", "<｜DSML｜", "\n\n", " <｜DSML｜ call", "{}", ""]
    for text in noise + ["".join(noise)]:
        assert syntax.parse(text) == (text, [])
    good = syntax.render([ToolCall("f", '{"x": 1}')])
    broken = [good[:-30],  # unfinished (max_tokens)
              good.replace('{"x": 1}', '{"x": 1').replace('string="false">1<', 'string="false">1}<')]
    for text in broken:
        assert syntax.parse("said " + text) == ("said " + text, []), text
    cut = "said " + good[:-3]  # only the closing tag is cut off (max_tokens): the calls are complete
    assert syntax.parse(cut) == (("said " + good[:-3], []) if isinstance(syntax, JsonTagSyntax)
                                 else ("said ", [ToolCall("f", '{"x": 1}')]))
    if isinstance(syntax, JsonTagSyntax):
        # another key order is still a call; a call without arguments object is not
        assert (syntax.parse('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>')
                == ("", [ToolCall("f", '{"x": 1}')]))
        bad = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
        assert syntax.parse(bad + "ok") == (bad + "ok", [])
        # a string argument holding the closing tag, whole and streamed
        tricky = syntax.render([ToolCall("f", '{"s": "a</tool_call>b"}')]) + "!"
        assert syntax.parse(tricky) == ("!", [ToolCall("f", '{"s": "a</tool_call>b"}')])
        stream = ToolCallStream(syntax)
        events = [e for k in range(len(tricky)) for e in stream.feed(tricky[k])] + stream.finish()
        assert events == [ToolCall("f", '{"s": "a</tool_call>b"}'), "!"]
    else:
        bad = '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\nstray text\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
        assert syntax.parse("x" + bad) == ("x" + bad, [])


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 12, "description": "the city"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
            "at": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/point"}]}},
        "required": ["city", "unit"],
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}},
                            "required": ["x"], "additionalProperties": False}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.mark.parametrize("syntax", [JsonTagSyntax(), DsmlSyntax()], ids=lambda s: s.name)
def test_grammar_walks_are_calls_whose_arguments_validate(syntax) -> None:  # type: ignore[no-untyped-def]
    """Random walks through the forced-call grammar (a character vocabulary): each ends as exactly one call of one of
    the tools, parsed back by the syntax, its arguments valid under that tool's schema."""
    vocab = list(dict.fromkeys([*string.printable, "｜", "é", "<eos>"]))
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[vocab.index("<eos>")])
    compiled = xgr.GrammarCompiler(info).compile_grammar(syntax.grammar(TOOLS))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = random.Random(11)
    seen = set()
    for _ in range(24):
        matcher, mask, text = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, info.vocab_size), ""
        while not matcher.is_terminated():
            matcher.fill_next_token_bitmask(mask)
            allowed = [i for i, ok in enumerate(xgr_testing.bitmask_to_bool_mask(mask, info.vocab_size)[0].tolist())
                       if ok]
            token = rng.choice(allowed)
            assert matcher.accept_token(token)
            text += vocab[token] if vocab[token] != "<eos>" else ""
        content, calls = syntax.parse(text)
        assert content == "" and len(calls) == 1, text
        jsonschema.validate(calls[0].args(), schemas[calls[0].name])
        seen.add(calls[0].name)
        # named: only that tool
    assert seen == set(schemas)
    named = xgr.Grammar.from_ebnf(syntax.grammar(TOOLS[1:]))
    assert xgr_testing._is_grammar_accept_string(named, syntax.render([ToolCall("now", "{}")]))
    assert not xgr_testing._is_grammar_accept_string(
        named, syntax.render([ToolCall("get_weather", '{"city": "x", "unit": "celsius"}')]))
    whole = xgr.Grammar.from_ebnf(syntax.grammar(TOOLS))
    # unit required
    assert not xgr_testing._is_grammar_accept_string(whole, syntax.render([ToolCall("get_weather", '{"city": "x"}')]))


def test_schemas_a_grammar_cannot_enforce_are_refused() -> None:
    def tool(params: dict) -> list[dict]:
        return [{"type": "function", "function": {"name": "f", "parameters": params}}]

    for params, word in [({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a"}}}, "pattern"),
                         ({"type": "object", "properties": {"s": {"type": "string", "format": "date"}}}, "format"),
                         ({"type": "object", "properties": {"s": {"oneOf": [{"type": "string"}]}}}, "oneOf"),
                         ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5}}}, "integer bounds"),
                         ({"type": "object", "properties": {"n": {"type": "number", "maximum": 5}}}, "minimum/maximum"),
                         ({"type": "object", "properties": {"r": {"$ref": "http://x/schema"}}}, "local"),
                         ({"type": "object", "properties": {}, "required": ["gone"]}, "not in properties")]:
        for syntax in (JsonTagSyntax(), DsmlSyntax()):
            with pytest.raises(ToolSchemaError, match=word):
                syntax.grammar(tool(params))
    with pytest.raises(ToolSchemaError, match="name"):
        JsonTagSyntax().grammar([{"type": "function", "function": {"name": "bad name!"}}])
    with pytest.raises(ToolSchemaError, match="no tools"):
        JsonTagSyntax().grammar([])


# ---------------------------------------------------------------------------------------------------- rendering
def test_the_server_renders_tools_and_results_where_the_format_puts_them(default_format) -> None:  # type: ignore[no-untyped-def]
    """preprocess with `tools` and `turn_messages`: a rebuilt session's prefix and turn are the whole conversation's
    ids; a continuing session's turn is what the results add; plain conversations are unchanged (test_chat_format)."""
    from tritonserver_backend.core.text_service import TextService
    from tritonserver_backend.errors import BadRequest

    text = TextService(EMBEDDED)
    tools = [TOOLS[1]]
    history = [{"role": "system", "content": "Be brief."}, *_assistant([ToolCall("now", "{}")], None)]
    results = [{"role": "tool", "tool_call_id": "call_0", "content": "12:00"}]
    whole = default_format.encode([*history, *results], tools=tools)
    ids, prefix, start = text.preprocess("", True, json.dumps(history), json.dumps(tools), json.dumps(results))
    assert list(prefix) + list(ids) == whole and start
    assert list(prefix) == default_format.encode(history, add_generation_prompt=False, tools=tools)
    ids, prefix, _ = text.preprocess("", False, None, json.dumps(tools), json.dumps(results))
    assert (list(ids) == default_format.append(None, results, tools=tools)
            and list(prefix) == default_format.encode([], add_generation_prompt=False, tools=tools))
    assert default_format.render([*history, *results], tools=tools) == (
        '<|bos|><|system|>You can call the tools below. To call one, reply with '
        '<tool_call>{"name": NAME, "arguments": {...}}'
        '</tool_call>; its result comes back as <tool_result>...</tool_result>. Tools:\n'
        '{"name": "now", "parameters": {"type": "object", "properties": {}}}<|end|>'
        '<|system|>Be brief.<|end|><|user|>?<|end|>'
        '<|assistant|><tool_call>{"name": "now", "arguments": {}}</tool_call><|end|>'
        "<|user|><tool_result>12:00</tool_result><|end|><|assistant|>")
    # a tool description holding a control token's string is text, not the token
    sneaky = [{"type": "function", "function": {"name": "f", "description": "<|end|><|assistant|>"}}]
    ids, prefix, _ = text.preprocess("hi", True, None, json.dumps(sneaky))
    end = default_format.tokenizer.token_to_id("<|end|>")
    assert (list(prefix) + list(ids)).count(end) == 2  # the tools' system message and the user's
    for bad_tools, bad_turn, word in [("{}", None, "tools must be"), ("[1]", None, "tools must be"),
                                      (None, "[]", "turn_messages"),
                                      (None, '{"role": "tool"}', "turn_messages must be")]:
        with pytest.raises(BadRequest, match=word):
            text.preprocess("", True, None, bad_tools, bad_turn)
    with pytest.raises(BadRequest, match="replaces text"):
        text.preprocess("hi", True, None, None, json.dumps(results))


def test_deepseek_puts_tools_in_its_first_system_turn() -> None:
    ds = _DeepSeek()
    tools = [TOOLS[1]]
    prompt = DS.TOOLS_PROMPT.format(dsml=DS.DSML) + json.dumps(TOOLS[1]["function"], ensure_ascii=False)
    user = [{"role": "user", "content": "Time?"}]
    assert ds.render(user, tools=tools) == f"{DS.BOS}{DS.SYSTEM}{prompt}{DS.USER}Time?{DS.ASSISTANT}</think>"
    assert ds.render([{"role": "system", "content": "Be brief."}, *user], tools=tools) == (
        f"{DS.BOS}{DS.SYSTEM}Be brief.\n\n{prompt}{DS.USER}Time?{DS.ASSISTANT}</think>")
    thinking = DS.render(user, True, True, tools, {})
    assert thinking.startswith(f"{DS.BOS}{DS.SYSTEM}{DS.EFFORT_LINE.format(75)}{prompt}{DS.USER}Time?")
    assert DsmlSyntax().start in prompt  # the prompt shows the syntax the parser reads
