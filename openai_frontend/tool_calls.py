"""Tools on chat completions: `tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and tool results in
the messages, and the calls parsed back out of the reply (`message.tool_calls`, streamed as `delta.tool_calls`).

- The tools go to the server (the tensor API's `tools` input) and the model directory's chat format renders them
  into the prompt where it puts tools; earlier assistant calls and tool results travel in `history` and, when the
  request ends with tool results, as the turn itself (`turn_messages`).
- The reply is read in the syntax the chat format writes calls in (`ced.text.tool_parsers.syntax_of`: the
  default's ``<tool_call>{...}</tool_call>``, DeepSeek-V4.1's DSML): text before a call is `content`, each complete
  call becomes a `tool_calls` entry (`call_` + 24 hex id), and a reply with calls ends with finish_reason
  "tool_calls". A call that does not parse stays in `content` as the model wrote it.
- `tool_choice`: "none" (the tools are not rendered, the reply is not parsed: the model never hears of them), "auto"
  (the default with tools: parsed if the model writes a call), "required" (one call of any tool) and
  {"type": "function", "function": {"name": ...}} (one call of that tool): the frontend sends the server a grammar
  (EBNF) that admits exactly one call in the format's syntax with arguments valid under the tool's `parameters`
  schema (`ToolSyntax.grammar`), so the reply is that call. A schema the grammar cannot enforce is a 400 naming its
  keyword. Forced replies hold one call; `parallel_tool_calls` false limits an auto reply to its first call.

A message's tool parts are kept in the conversation key of the prefix cache (`Message` tuples get a third element,
`extra`, the canonical JSON of its tool_calls or tool_call_id), so a resent conversation with the calls as this
frontend returned them continues the same session; the tool list is part of the cache's partition (`namespace`).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ced.text.tool_parsers import ToolCall, ToolCallStream, ToolSchemaError, ToolSyntax, syntax_of
from openai_frontend.errors import bad_request

CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tools:
    """A request's tools: the definitions as sent, what tool_choice asks for, and whether calls may be several."""

    definitions: tuple[dict, ...] = ()
    choice: str = "none"  # "none" | "auto" | "required" | "function" (named)
    name: str = ""  # the named function
    parallel: bool = True

    @property
    def rendered(self) -> bool:
        return bool(self.definitions) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def json(self) -> str | None:
        """The tensor API's `tools` input (None when the tools are not rendered)."""
        return json.dumps(list(self.definitions), ensure_ascii=False, separators=(",", ":")) if self.rendered else None

    def namespace(self, namespace: str) -> str:
        """The prefix-cache partition of a conversation with these tools rendered: a session holds the tools' text."""
        if not self.rendered:
            return namespace
        digest = hashlib.sha256(self.json().encode("utf-8")).hexdigest()  # type: ignore[union-attr]
        return f"{namespace}+tools:{digest}"

    def grammar(self, syntax: ToolSyntax) -> dict | None:
        """The tensor API's grammar spec forcing one call (tool_choice required or named), else None."""
        if not self.forced:
            return None
        targets = ([t for t in self.definitions if _name(t) == self.name] if self.choice == "function"
                   else list(self.definitions))
        try:
            return {"type": "ebnf", "grammar": syntax.grammar(targets)}
        except ToolSchemaError as exc:
            raise bad_request(f"tool_choice {self.choice}: {exc}", "tools") from None


    def auto_grammar(self, syntax: ToolSyntax) -> dict | None:
        """tool_choice auto: the tensor API's grammar spec that keeps the reply free until the model opens a call, and
        from there admits only a call of an offered tool with arguments valid under its schema (a structural tag,
        as Dynamo and vLLM constrain auto calls). None when the syntax has none, or a tool's schema is outside what
        the forced-call grammar enforces (that reply is parsed as written, as before)."""
        if self.choice != "auto" or not self.rendered:
            return None
        try:
            fmt = syntax.auto_format(list(self.definitions), first_only=not self.parallel)
        except ToolSchemaError:
            return None
        return {"type": "structural_tag", "format": fmt} if fmt is not None else None


def _name(tool: dict) -> str:
    return str((tool.get("function") or {}).get("name", ""))


def parse_tools(tools: list | None, tool_choice: Any, parallel: bool | None) -> Tools:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked (OpenAI's shapes and rules)."""
    tools = tools or []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                              '{...}}}',
                              "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    names = [_name(t) for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: each function needs a name of its own", "tools")
    choice, name = "auto" if tools else "none", ""
    if tool_choice is not None:
        if isinstance(tool_choice, str) and tool_choice in CHOICES:
            choice = tool_choice
        elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
                and isinstance(tool_choice.get("function"), dict) \
                and isinstance(tool_choice["function"].get("name"), str):
            choice, name = "function", tool_choice["function"]["name"]
            if name not in names:
                raise bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        else:
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                              '{"name": ...}}', "tool_choice")
    if choice in ("auto", "required") and not tools:
        raise bad_request(f'tool_choice "{choice}" needs tools', "tool_choice")
    return Tools(tuple(tools), choice, name, parallel is not False)


# ---------------------------------------------------------------------------------------------------- messages
def extra_of_calls(calls: list[tuple[str, str, str]]) -> str:
    """The canonical `extra` of an assistant message with tool calls: [(id, name, arguments), ...]."""
    return json.dumps({"tool_calls": [list(c) for c in calls]}, ensure_ascii=False, separators=(",", ":"))


def extra_of_result(tool_call_id: str) -> str:
    return json.dumps({"tool_call_id": tool_call_id}, ensure_ascii=False, separators=(",", ":"))


def message_calls(i: int, calls: list) -> list[tuple[str, str, str]]:
    """An incoming assistant message's tool_calls -> [(id, name, arguments)] (arguments must be a JSON object's
    text)."""
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments", ""), str)):
            raise bad_request(f"messages[{i}].tool_calls[{k}] needs function.name and function.arguments "
                              "(a JSON string)", f"messages.{i}.tool_calls")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise bad_request(f"messages[{i}].tool_calls[{k}].function.arguments must be a JSON object",
                              f"messages.{i}.tool_calls")
        out.append((str(call.get("id") or ""), fn["name"], fn.get("arguments") or "{}"))
    return out


def wire(message: tuple) -> dict:
    """A `schemas.Message` tuple -> the message the chat format renders (history, turn_messages, token counts)."""
    role, content = message[0], message[1]
    if len(message) < 3:
        return {"role": role, "content": content}
    extra = json.loads(message[2])
    if "tool_calls" in extra:
        return {"role": role, "content": content or None,
                "tool_calls": [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                               for i, n, a in extra["tool_calls"]]}
    return {"role": role, "content": content, "tool_call_id": extra.get("tool_call_id", "")}


# ---------------------------------------------------------------------------------------------------- replies
@dataclass
class ToolReply:
    """The reply's text through the tool-call parser: content goes on, complete calls are collected (and handed out
    once each to the stream, `take`)."""

    syntax: ToolSyntax
    parallel: bool = True
    calls: list[tuple[str, ToolCall]] = field(default_factory=list)  # (id, call)
    content: str = ""  # the reply's text without its calls, so far
    _stream: ToolCallStream = field(init=False)
    _given: int = 0

    def __post_init__(self) -> None:
        self._stream = ToolCallStream(self.syntax)

    def feed(self, text: str, final: bool = False) -> str:
        events = self._stream.feed(text) if text else []
        if final:
            events += self._stream.finish()
        out = []
        for e in events:
            if isinstance(e, ToolCall):
                if self.parallel or not self.calls:
                    self.calls.append((f"call_{uuid.uuid4().hex[:24]}", e))
            else:
                out.append(e)
        self.content += "".join(out)
        return "".join(out)

    @property
    def waiting(self) -> bool:
        """Calls the stream has not handed out yet."""
        return self._given < len(self.calls)

    def take(self) -> list[tuple[int, str, ToolCall]]:
        """The calls not handed out yet: (index, id, call)."""
        new = [(k, i, c) for k, (i, c) in enumerate(self.calls) if k >= self._given]
        self._given = len(self.calls)
        return new

    def message_calls(self) -> list[dict]:
        return [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in self.calls]

    def extra(self) -> str:
        return extra_of_calls([(i, c.name, c.arguments) for i, c in self.calls])


def stream_deltas(index: int, call_id: str, call: ToolCall) -> list[dict]:
    """OpenAI's streamed shape of one call: its id, type and name (empty arguments), then the arguments."""
    return [{"tool_calls": [{"index": index, "id": call_id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


_SYNTAX: dict[int, ToolSyntax | None] = {}


def syntax_for(chat_format: Any) -> ToolSyntax:
    """The chat format's tool-call syntax, or a 400: a format that writes none cannot take tools."""
    if id(chat_format) not in _SYNTAX:
        _SYNTAX[id(chat_format)] = syntax_of(chat_format)
    syntax = _SYNTAX[id(chat_format)]
    if syntax is None:
        raise bad_request("this model's chat format writes no tool-call syntax the server can parse (the default's "
                          "<tool_call> JSON or DeepSeek-V4.1's DSML), so it cannot take tools", "tools")
    return syntax
