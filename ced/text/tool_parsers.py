"""Tool calls in a model's own syntax: parsed back out of a reply (whole or streamed), and the grammar that forces one.

A chat format renders an assistant message's ``tool_calls`` into text (`chat_format`); a model trained on that format
writes its calls the same way. This module reads that text back into calls, so the syntax of each format is whatever
its renderer writes, and the tests check parse(render(calls)) == calls:

- ``deepseek-v4.1`` (`DsmlSyntax`): ``\\n\\n<｜DSML｜ calls>\\n`` + invokes joined by ``\\n`` +
  ``\\n</｜DSML｜ calls>``, an invoke being ``<｜DSML｜ invoke name="NAME">\\n`` + parameters joined by ``\\n`` +
  ``\\n</｜DSML｜ invoke>`` and a parameter ``<｜DSML｜ parameter name="K" string="true|false">V</｜DSML｜ parameter>``
  (a string as is, any other value as JSON). Its limits are the renderer's: a string value holding
  ``</｜DSML｜ parameter>`` cannot be told from the end of the parameter.
- the default's template (`JsonTagSyntax`; the template in `ced.text.tokenizer`, which defines it since the
  default had none): each call is ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>`` right after the
  message's text (NAME a JSON string, ARGS the arguments' JSON object as the client sent them), calls one after the
  other with nothing between them.

`syntax_of` picks the syntax a chat format uses by rendering a probe call with it and keeping the syntax that parses
it back: so any Jinja template that writes one of these two syntaxes is served, and one that writes neither has no
tool-call parsing (tools are then refused, not silently ignored).

Streaming (`ToolCallStream`): text before a call streams as content; a tail that may still become the opening of a
call is held back until it is known; a call is emitted once it is complete (its closing tag seen), so a client gets
each call whole, the same as the non-streamed reply (which is parsed by the same machine). A call that does not parse
(broken JSON, unknown layout) stays in the content as the model wrote it, and so does an unfinished one at the end of
the reply (``max_tokens``).

`ToolSyntax.grammar`: an EBNF grammar (xgrammar's dialect, GBNF-style) that admits exactly one call of one of the given
tools in this syntax, with arguments valid under the tool's ``parameters`` JSON schema: what ``tool_choice`` required
or named constrains generation with. Only a subset of JSON Schema can be turned into a grammar here (`SchemaGrammar`);
a schema outside it is refused with the keyword named (`ToolSchemaError`), never half-honoured.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments' JSON object, as text

    def args(self) -> dict:
        return json.loads(self.arguments)


class ToolSchemaError(ValueError):
    """A tool's parameters schema (or the tool list) cannot be turned into a grammar: the client's error (a 400)."""


# ---------------------------------------------------------------------------------------------------- syntaxes
class ToolSyntax:
    """How one chat format writes tool calls. `start` opens the calls; `lead` is what the renderer writes between the
    message's text and `start` (not part of the content)."""

    name = ""
    start = ""
    lead = ""

    def next_call(self, buf: str) -> tuple[str, ToolCall | None, int]:
        """Given the text after the opening (or after the previous call): ("more", None, 0) when it cannot tell yet,
        ("call", call, n) a complete call in the first n characters, ("bad", None, n) n characters of a call that does
        not parse, ("end", None, n) the calls ended after n characters (what follows is text again)."""
        raise NotImplementedError

    def after_start(self) -> int:
        """How many characters of `start` the calls' parser consumes (the rest belongs to the first call)."""
        return len(self.start)

    def closing(self, rest: str) -> bool:
        """Whether `rest`, left at the end of a reply after complete calls, is only the start of the calls' closing."""
        return False

    def render(self, calls: Sequence[ToolCall]) -> str:
        """The calls as this syntax writes them (what `ToolCallStream` parses; the chat format is the spec)."""
        raise NotImplementedError

    def auto_format(self, tools: Sequence[Mapping], first_only: bool) -> dict | None:
        """For tool_choice auto: a structural tag (xgrammar's ``triggered_tags``) that leaves the reply free until the
        model writes the calls' opening, and from there admits only a call of one of `tools` with arguments valid
        under its schema; None where this syntax has none (the reply is then parsed as written). `first_only`: at
        most one call (parallel_tool_calls false). Raises ToolSchemaError for a tool it cannot constrain."""
        return None

    def grammar(self, tools: Sequence[Mapping]) -> str:
        raise NotImplementedError

    # ------------------------------------------------------------------ whole replies
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A complete reply -> (its text without the calls, the calls)."""
        stream = ToolCallStream(self)
        events = stream.feed(text) + stream.finish()
        return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]


class JsonTagSyntax(ToolSyntax):
    """``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` (the default's template)."""

    name = "json-tag"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    start = OPEN
    _LAYOUT = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(.*?)\s*\}\s*', re.DOTALL)

    def after_start(self) -> int:
        return 0  # each call carries its own opening tag

    def next_call(self, buf: str) -> tuple[str, ToolCall | None, int]:
        s = buf.lstrip()
        ws = len(buf) - len(s)
        if not s or (self.OPEN.startswith(s) and s != self.OPEN):
            return "more", None, 0
        if not s.startswith(self.OPEN):
            return "end", None, 0
        ends = [m.start() for m in re.finditer(re.escape(self.CLOSE), s)]
        if not ends:
            return "more", None, 0
        for j in ends:  # a string argument may hold the closing tag itself: the first end at which the call parses
            call = self._call(s[len(self.OPEN):j])
            if call is not None:
                return "call", call, ws + j + len(self.CLOSE)
        if _unterminated(s[len(self.OPEN):ends[-1]]):
            return "more", None, 0  # inside a string still: its closing tag is yet to come
        return "bad", None, ws + ends[0] + len(self.CLOSE)

    def _call(self, inner: str) -> ToolCall | None:
        m = self._LAYOUT.fullmatch(inner)
        if m is not None:  # the layout the template writes: the arguments are kept as written
            try:
                name, args = json.loads(m.group(1)), json.loads(m.group(2))
            except json.JSONDecodeError:
                name = args = None
            if isinstance(name, str) and name and isinstance(args, dict):
                return ToolCall(name, m.group(2))
        try:  # any other JSON object with a name and object arguments (keys in another order, say)
            obj = json.loads(inner)
        except json.JSONDecodeError:
            return None
        if (isinstance(obj, dict) and set(obj) == {"name", "arguments"} and isinstance(obj["name"], str)
                and obj["name"] and isinstance(obj["arguments"], dict)):
            return ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))
        return None

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "".join(f'{self.OPEN}{{"name": {json.dumps(c.name, ensure_ascii=False)}, '
                       f'"arguments": {c.arguments}}}{self.CLOSE}'
                       for c in calls)

    def auto_format(self, tools: Sequence[Mapping], first_only: bool) -> dict | None:
        self.grammar(tools)  # the same schema subset as a forced call: a tool it cannot enforce stays unconstrained
        tags = [{"type": "tag",
                 "begin": f'{self.OPEN}{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": ',
                 "content": {"type": "json_schema",
                             "json_schema": fn.get("parameters") or {"type": "object", "properties": {}}},
                 "end": "}" + self.CLOSE}
                for fn in _functions(tools)]
        return {"type": "triggered_tags", "triggers": [self.OPEN], "tags": tags, "at_least_one": False,
                "stop_after_first": first_only}

    def grammar(self, tools: Sequence[Mapping]) -> str:
        g = SchemaGrammar()
        calls = []
        for i, fn in enumerate(_functions(tools)):
            args = g.value(g.tool(fn, f"t{i}"), f"t{i}")
            head = f'{self.OPEN}{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": '
            calls.append(g.rule(f"call{i}", f"{lit(head)} {args} {lit('}' + self.CLOSE)}"))
        return g.text(" | ".join(calls))


def _unterminated(text: str) -> bool:
    """Whether JSON text stops inside a string (so more of it may follow)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return exc.msg.startswith("Unterminated string")
    return False


class DsmlSyntax(ToolSyntax):
    """DeepSeek-V4.1's DSML calls (`chat_format.DeepSeekV41Format._calls`)."""

    name = "deepseek-v4.1-dsml"
    DSML = "｜DSML｜"
    CALLS, END_CALLS = f"<{DSML} calls>", f"</{DSML} calls>"
    INVOKE, END_INVOKE = f'<{DSML} invoke name="', f"</{DSML} invoke>"
    END_PARAM = f"</{DSML} parameter>"
    start = CALLS
    lead = "\n\n"
    _HEAD = re.compile(rf'<{DSML} invoke name="([^"<>]+)">')
    _PARAM = re.compile(rf'<{DSML} parameter name="([^"<>]+)" string="(true|false)">(.*?)</{DSML} parameter>',
                        re.DOTALL)

    def next_call(self, buf: str) -> tuple[str, ToolCall | None, int]:
        s = buf.lstrip()
        ws = len(buf) - len(s)
        if not s or any(t.startswith(s) and t != s for t in (self.END_CALLS, self.INVOKE)):
            return "more", None, 0
        if s.startswith(self.END_CALLS):
            return "end", None, ws + len(self.END_CALLS)
        if not s.startswith(self.INVOKE):
            return "bad", None, len(buf)  # not a DSML block after all: the rest is text
        j = s.find(self.END_INVOKE)
        if j < 0:
            return "more", None, 0
        n = ws + j + len(self.END_INVOKE)
        call = self._call(s[:j])
        return ("call", call, n) if call is not None else ("bad", None, n)

    def closing(self, rest: str) -> bool:
        return self.END_CALLS.startswith(rest.lstrip())

    def _call(self, invoke: str) -> ToolCall | None:
        head = self._HEAD.match(invoke)
        if head is None:
            return None
        body, args, pos = invoke[head.end():], {}, 0
        for m in self._PARAM.finditer(body):
            if body[pos:m.start()].strip() or m.group(1) in args:
                return None
            value: Any = m.group(3)
            if m.group(2) == "false":
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    return None
            args[m.group(1)] = value
            pos = m.end()
        if body[pos:].strip():
            return None
        return ToolCall(head.group(1), json.dumps(args, ensure_ascii=False))

    def render(self, calls: Sequence[ToolCall]) -> str:
        invokes = []
        for c in calls:
            params = [f'<{self.DSML} parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                      f'{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}{self.END_PARAM}'
                      for k, v in c.args().items()]
            invokes.append(f'{self.INVOKE}{c.name}">\n' + "\n".join(params) + f"\n{self.END_INVOKE}")
        return f"{self.lead}{self.CALLS}\n" + "\n".join(invokes) + f"\n{self.END_CALLS}"

    def grammar(self, tools: Sequence[Mapping]) -> str:
        g = SchemaGrammar()
        calls = []
        for i, fn in enumerate(_functions(tools)):
            schema = g.resolve(g.tool(fn, f"t{i}"))
            _object_only(schema, fn["name"])
            check = SchemaGrammar()  # the whole schema's checks (the parameters below are written DSML's way)
            check.value(check.tool(fn, "c"), "c")
            members = []
            for k, (key, sub) in enumerate((schema.get("properties") or {}).items()):
                if not re.fullmatch(r'[^"<>]+', key):
                    raise ToolSchemaError(f"tool {fn['name']!r}: parameter name {key!r} cannot be written in DSML")
                head = f'<{self.DSML} parameter name="{key}" string='
                if _is_string(g.resolve(sub)):
                    value = lit(head + '"true">') + " " + g.raw_string(g.resolve(sub), f"t{i}p{k}")
                else:
                    value = lit(head + '"false">') + " " + g.value(sub, f"t{i}p{k}")
                members.append((g.rule(f"t{i}m{k}", f"{value} {lit(self.END_PARAM)}"),
                                key in (schema.get("required") or ())))
            params = g.members(members, lit("\n"), f"t{i}s")
            head, tail = lit(f'{self.INVOKE}{fn["name"]}">\n'), lit(f"\n{self.END_INVOKE}")
            calls.append(g.rule(f"call{i}", f"{head} {params} {tail}" if params else f"{head} {tail}"))
        return g.text(f"{lit(f'{self.lead}{self.CALLS}{chr(10)}')} ({' | '.join(calls)}) "
                      f"{lit(f'{chr(10)}{self.END_CALLS}')}")


SYNTAXES: tuple[ToolSyntax, ...] = (DsmlSyntax(), JsonTagSyntax())
PROBE = ToolCall("probe_tool", '{"city": "Paris", "days": 2}')


def syntax_of(chat_format: Any) -> ToolSyntax | None:
    """The syntax `chat_format` (a `ChatFormat`) writes an assistant's tool calls in: the one that parses back a
    probe call rendered by it; None when no syntax here does (or the format refuses tool calls)."""
    probe = [{"role": "user", "content": "?"},
             {"role": "assistant", "content": "", "tool_calls": [{"id": "call_probe", "type": "function",
                                                                  "function": {"name": PROBE.name,
                                                                               "arguments": PROBE.arguments}}]}]
    try:
        text = chat_format.render(probe, add_generation_prompt=False)
    except ValueError:
        return None
    for syntax in SYNTAXES:
        at = text.find(syntax.lead + syntax.start)
        if at < 0:
            continue
        _, calls = syntax.parse(text[at:])
        if [(c.name, c.args()) for c in calls] == [(PROBE.name, PROBE.args())]:
            return syntax
    return None


# ---------------------------------------------------------------------------------------------------- streaming
class ToolCallStream:
    """Text of a reply as it arrives -> events: str (content, final) and `ToolCall` (a complete call)."""

    def __init__(self, syntax: ToolSyntax) -> None:
        self.syntax = syntax
        self.buf = ""
        self.in_calls = False
        self._opening = ""  # the calls' opening text consumed so far: content again if their first call is bad
        self._calls = 0  # calls taken since the opening

    def feed(self, text: str) -> list[str | ToolCall]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[str | ToolCall]:
        """At the end of the reply: what was held back, as content (an unfinished call stays text)."""
        events = self._run(final=True)
        if self.in_calls and self._calls and self.syntax.closing(self.buf):
            self.buf = ""  # the calls were complete and only their closing tag was cut off
        if self.buf or (self.in_calls and not self._calls and self._opening):
            _content(events, (self._opening if self.in_calls and not self._calls else "") + self.buf)
        self.buf, self.in_calls = "", False
        return events

    def _run(self, final: bool) -> list[str | ToolCall]:
        syntax = self.syntax
        events: list[str | ToolCall] = []
        while self.buf:
            if not self.in_calls:
                at = self.buf.find(syntax.start)
                if at < 0:
                    keep = 0 if final else _held(self.buf, syntax.start, bool(syntax.lead))
                    _content(events, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return events
                before = self.buf[:at]
                led = bool(syntax.lead) and before.endswith(syntax.lead)
                _content(events, before[:-len(syntax.lead)] if led else before)
                self._opening = (syntax.lead if led else "") + syntax.start[:syntax.after_start()]
                self.buf = self.buf[at + syntax.after_start():]
                self.in_calls, self._calls = True, 0
                continue
            kind, call, n = syntax.next_call(self.buf)
            if kind == "more":
                return events
            if kind == "call":
                events.append(call)  # type: ignore[arg-type]
                self._calls += 1
            elif kind == "bad":
                _content(events, (self._opening if not self._calls else "") + self.buf[:n])
            if kind in ("end", "bad"):
                self.in_calls = False
            self.buf = self.buf[n:]
        return events


def _content(events: list[str | ToolCall], text: str) -> None:
    if text:
        events.append(text)


def _held(buf: str, marker: str, lead: bool) -> int:
    """How much of `buf`'s end may still become `marker` (a proper prefix of it; with a lead, after whitespace)."""
    n = next((k for k in range(min(len(buf), len(marker) - 1), 0, -1) if marker.startswith(buf[-k:])), 0)
    if lead:
        rest = buf[:len(buf) - n]
        n += len(rest) - len(rest.rstrip())
    return n


# ---------------------------------------------------------------------------------------------------- grammars
def lit(text: str) -> str:
    """An EBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _functions(tools: Sequence[Mapping]) -> list[Mapping]:
    """OpenAI tools ({"type": "function", "function": {...}}) -> their function objects, checked."""
    if not tools:
        raise ToolSchemaError("no tools to call")
    fns = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) and "function" in tool else tool
        if (not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str)
                or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn["name"])):
            raise ToolSchemaError(f"tools[{i}]: a function needs a name of 1-64 letters, digits, '_', '.' or '-'")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise ToolSchemaError(f"tools[{i}] ({fn['name']}): parameters must be a JSON schema object")
        fns.append(fn)
    return fns


def _object_only(schema: Mapping, name: str) -> None:
    if (schema.get("type", "object") != "object"
            or any(k in schema for k in ("anyOf", "oneOf", "allOf", "enum", "const"))):
        raise ToolSchemaError(f"tool {name!r}: parameters must be an object schema with properties")


def _is_string(schema: Mapping) -> bool:
    if "enum" in schema:
        return bool(schema["enum"]) and all(isinstance(v, str) for v in schema["enum"])
    if "const" in schema:
        return isinstance(schema["const"], str)
    return schema.get("type") == "string"


ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
               "writeOnly", "additionalProperties", "strict"}
KEYWORDS = {"type", "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions", "properties", "required",
            "items", "minItems", "maxItems", "minLength", "maxLength", "minimum", "maximum"}
MAX_INT_RANGE = 256  # an integer range up to this size is written out; a wider bounded one is refused
JSON_VALUE_RULES = r'''jv ::= jobj | jarr | jstr | jnum | "true" | "false" | "null"
jobj ::= "{" (jstr ": " jv (", " jstr ": " jv)*)? "}"
jarr ::= "[" (jv (", " jv)*)? "]"
jstr ::= "\"" jchar* "\""
jchar ::= [^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})
jint ::= "-"? ("0" | [1-9] [0-9]{0,15})
jnum ::= jint ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?'''


class SchemaGrammar:
    """A JSON Schema -> EBNF rules for the JSON text ``json.dumps`` writes (", " and ": " separators), subset:
    ``type`` (one or a list), ``enum``, ``const``, ``anyOf``, ``allOf`` of one schema, local ``$ref`` (``#/$defs/..``,
    ``#/definitions/..``), objects (``properties``, ``required``; only declared properties are written, required ones
    first), arrays (``items``, ``minItems``, ``maxItems``), strings (``minLength``, ``maxLength``), integers (with
    ``minimum`` 0 or 1 and no ``maximum``, or a range of at most 256 values), numbers, booleans, null. Annotations
    (``description``, ``title``, ``default``, ...) are ignored; any other keyword (``pattern``, ``format``,
    ``oneOf``, ...) is refused. Integers are written with at most 16 digits."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self.root_schema: Mapping = {}  # the tool's parameters: what local $refs point into
        self.scope = ""
        self._refs: dict[str, str] = {}

    def tool(self, fn: Mapping, scope: str) -> Mapping:
        """Start a tool's schema (its $refs resolve within it; its rules are named under `scope`)."""
        self.root_schema = fn.get("parameters") or {"type": "object", "properties": {}}
        self.scope = scope
        return self.root_schema

    def text(self, root: str) -> str:
        lines = [f"root ::= {root}"] + [f"{k} ::= {v}" for k, v in self.rules.items()]
        return "\n".join(lines) + "\n" + JSON_VALUE_RULES + "\n"

    def rule(self, name: str, body: str) -> str:
        self.rules[name] = body
        return name

    def resolve(self, schema: Any) -> Mapping:
        if not isinstance(schema, Mapping):
            raise ToolSchemaError(f"a schema must be a JSON object, got {json.dumps(schema)[:60]}")
        seen = 0
        while "$ref" in schema:
            schema = self._target(schema["$ref"])
            seen += 1
            if seen > 32:
                raise ToolSchemaError("$ref chain too long")
        return schema

    def _target(self, ref: Any) -> Mapping:
        m = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
        target = (self.root_schema.get(m.group(1)) or {}).get(m.group(2)) if m else None
        if not isinstance(target, Mapping):
            raise ToolSchemaError(f"$ref {ref!r}: only local #/$defs/NAME or #/definitions/NAME "
                                  "references are supported")
        return target

    def value(self, schema: Any, name: str) -> str:
        """An EBNF expression (usually a rule name) for a JSON value valid under `schema`."""
        if isinstance(schema, Mapping) and "$ref" in schema and len(schema) == 1:
            ref = (self.scope, schema["$ref"])
            if ref not in self._refs:  # a rule per definition, so recursive schemas stay finite
                self._refs[ref] = f"{self.scope}d{len(self._refs)}"
                self.rule(self._refs[ref], self.value(self._target(ref[1]), self._refs[ref] + "v"))
            return self._refs[ref]
        if schema is True or schema == {}:
            return "jv"
        schema = self.resolve(schema)
        unknown = sorted(set(schema) - ANNOTATIONS - KEYWORDS)
        if unknown:
            raise ToolSchemaError(f"the JSON schema keyword{'s' if len(unknown) > 1 else ''} {unknown} cannot be "
                                  "enforced by a grammar here (supported: type, enum, const, anyOf, properties, "
                                  "required, items, minItems, maxItems, minLength, maxLength, integer minimum/maximum, "
                                  "local $ref)")
        if "allOf" in schema:
            if (not isinstance(schema["allOf"], list) or len(schema["allOf"]) != 1
                    or len(set(schema) - ANNOTATIONS) != 1):
                raise ToolSchemaError("allOf is supported with one schema only")
            return self.value(schema["allOf"][0], name)
        if "anyOf" in schema:
            if len(set(schema) - ANNOTATIONS - {"$defs", "definitions"}) != 1 or not schema["anyOf"]:
                raise ToolSchemaError("anyOf cannot be combined with other keywords here")
            return self.rule(name, " | ".join(self.value(s, f"{name}a{k}") for k, s in enumerate(schema["anyOf"])))
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            if not isinstance(values, list) or not values:
                raise ToolSchemaError("enum must be a non-empty list")
            return self.rule(name, " | ".join(lit(json.dumps(v, ensure_ascii=False)) for v in values))
        types = schema.get("type")
        if types is None:
            if any(k in schema for k in ("properties", "required")):
                types = "object"
            elif "items" in schema:
                types = "array"
            else:
                return "jv"
        if isinstance(types, list):
            if not types:
                raise ToolSchemaError("type must not be an empty list")
            return self.rule(name, " | ".join(self.value({**schema, "type": t}, f"{name}y{k}")
                                              for k, t in enumerate(types)))
        if types == "object":
            return self._object(schema, name)
        if types == "array":
            return self._array(schema, name)
        if types == "string":
            return self.rule(name, f'"\\"" {self._repeat("jchar", schema, name)} "\\""')
        if types == "integer":
            return self._integer(schema, name)
        if types == "number":
            if "minimum" in schema or "maximum" in schema:
                raise ToolSchemaError("minimum/maximum on a number cannot be enforced by a grammar here "
                                      "(integers: yes)")
            return "jnum"
        if types == "boolean":
            return self.rule(name, '"true" | "false"')
        if types == "null":
            return lit("null")
        raise ToolSchemaError(f"unknown JSON schema type {types!r}")

    def raw_string(self, schema: Mapping, name: str) -> str:
        """A string written as is (DSML's string="true" parameters): no '<', so it cannot close the parameter."""
        unknown = sorted(set(schema) - ANNOTATIONS - {"type", "enum", "const", "minLength", "maxLength"})
        if unknown:
            raise ToolSchemaError(f"the JSON schema keyword{'s' if len(unknown) > 1 else ''} {unknown} cannot be "
                                  "enforced by a grammar here")
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            return self.rule(name, " | ".join(lit(v) for v in values))
        self.rules.setdefault("rawchar", "[^<]")
        return self.rule(name, self._repeat("rawchar", schema, name))

    def members(self, members: list[tuple[str, bool]], sep: str, name: str) -> str:
        """Required members in order, then any subset of the optional ones in order, joined by `sep`; "" for none."""
        required = [m for m, r in members if r]
        optional = [m for m, r in members if not r]
        tail = ""
        for k in range(len(optional) - 1, -1, -1):  # s_k ::= o_k (sep s_k+1)? | s_k+1
            rule = f"{name}{k}"
            self.rule(rule, f"{optional[k]} ({sep} {tail})? | {tail}" if tail else optional[k])
            tail = rule
        head = f" {sep} ".join(required)
        if head and tail:
            return f"{head} ({sep} {tail})?"
        return head or (f"({tail})?" if tail else "")

    def _object(self, schema: Mapping, name: str) -> str:
        props = schema.get("properties") or {}
        required = schema.get("required") or []
        if not isinstance(props, Mapping) or not isinstance(required, list):
            raise ToolSchemaError("properties must be an object and required a list")
        missing = [k for k in required if k not in props]
        if missing:
            raise ToolSchemaError(f"required properties {missing} are not in properties "
                                  "(a grammar writes only declared ones)")
        members = [(self.rule(f"{name}p{k}",
                              f"{lit(json.dumps(key, ensure_ascii=False) + ': ')} {self.value(sub, f'{name}p{k}v')}"),
                    key in required) for k, (key, sub) in enumerate(props.items())]
        inner = self.members(members, lit(", "), f"{name}o")
        return self.rule(name, f'"{{" {inner} "}}"' if inner else lit("{}"))

    def _array(self, schema: Mapping, name: str) -> str:
        item = self.value(schema.get("items", True), f"{name}i")
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        if hi is not None and int(hi) < lo:
            raise ToolSchemaError("maxItems < minItems")
        if hi == 0:
            return lit("[]")
        rest = f"{{{max(lo - 1, 0)},{'' if hi is None else int(hi) - 1}}}"
        body = f'{item} ({lit(", ")} {item}){rest}'
        return self.rule(name, f'"[" {body} "]"' if lo >= 1 else f'"[" ({body})? "]"')

    def _repeat(self, char: str, schema: Mapping, name: str) -> str:
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        if hi is not None and int(hi) < lo:
            raise ToolSchemaError("maxLength < minLength")
        if lo == 0 and hi is None:
            return f"{char}*"
        return f"{char}{{{lo},{'' if hi is None else int(hi)}}}"

    def _integer(self, schema: Mapping, name: str) -> str:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        for bound in (lo, hi):
            if bound is not None and (not isinstance(bound, (int, float)) or isinstance(bound, bool)
                                      or bound != int(bound)):
                raise ToolSchemaError("integer minimum/maximum must be integers")
        if lo is None and hi is None:
            return "jint"
        if lo is not None and hi is not None:
            lo, hi = int(lo), int(hi)
            if hi < lo or hi - lo + 1 > MAX_INT_RANGE:
                raise ToolSchemaError(f"an integer range must hold 1 to {MAX_INT_RANGE} values to be enforced here")
            return self.rule(name, " | ".join(lit(str(v)) for v in range(lo, hi + 1)))
        if hi is None and lo in (0, 1):
            return self.rule(name, '"0" | [1-9] [0-9]{0,15}' if lo == 0 else '[1-9] [0-9]{0,15}')
        raise ToolSchemaError("integer bounds other than minimum 0 or 1, or a range of at most "
                              f"{MAX_INT_RANGE} values, cannot be enforced by a grammar here")
