"""Structured replies as training and evaluation data: JSON records from random schemas, tool-use conversations in
the default's chat format, and JSON inside code and CSS.

Why: the default never put weight on a closing quote, so every grammar-bound reply ran to `max_tokens` inside its
first string (issue 50). The grammar keeps each prefix valid; only the model decides when a string, an array or a
number ends. These generators show it, seeded, many times: short and long strings that close, arrays of one to five
items, numbers of typical lengths, tool calls whose arguments come from the request, and a plain answer when the
request asks for no action.

Every value is drawn from the prepared corpora (`WordPools.from_corpora`, one split at a time), so the evaluation
draws its values from the *test* split while training draws from *train*. Tools are compositions of a verb and an
object (`get_weather`, `send_invoice`); a fixed hash keeps a quarter of the compositions for evaluation only
(`held_out_tool`), and schemas and requests of the evaluation come from other seeds. The reply formats are the ones
the server's grammars admit: `json.dumps` compact separators for response_format replies (`JSON_SEPARATORS` of the
sampler) and the template's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` with default separators.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

COMPACT = (",", ":")  # what the sampler's JSON grammar admits (tritonserver_backend.sampling.grammar)
# json_object replies: xgrammar's grammar for {"type": "object"} puts ", " between members and items whatever the
# separators asked for; a model that only saw COMPACT is off its training text there (StructuredData's
# object_style_share writes that share of the replies this way)
OBJECT_STYLE = (", ", ":")

FIELDS = (
    "name", "title", "tags", "id", "count", "price", "active", "color", "size", "status", "author", "year", "items",
    "description", "label", "kind", "score", "enabled", "level", "city", "country", "email", "phone", "summary",
    "language", "version", "width", "height", "message", "topic", "owner", "priority", "notes", "rating", "total",
    "category", "source", "target", "path", "command", "options", "user", "role", "age", "date", "time", "query",
    "result", "values", "keywords", "mood", "reply", "answer", "question", "reason", "format", "unit", "amount",
)
ENUM_WORDS = (
    ("low", "medium", "high"), ("red", "green", "blue", "black"), ("small", "large"), ("open", "closed", "pending"),
    ("yes", "no", "maybe"), ("draft", "final"), ("celsius", "fahrenheit"), ("left", "right", "center"),
    ("happy", "sad", "angry", "calm"), ("python", "css", "shell", "text"), ("daily", "weekly", "monthly"),
)
VERBS = ("get", "search", "send", "create", "delete", "list", "book", "convert", "translate", "set", "play", "find",
         "check", "cancel", "update", "open", "schedule", "order", "add", "remove")
OBJECTS = ("weather", "file", "email", "event", "reminder", "order", "song", "flight", "hotel", "table", "recipe",
           "stock", "timer", "alarm", "note", "contact", "package", "ticket", "meeting", "playlist", "invoice",
           "document", "route", "price", "news", "photo", "message", "task", "account", "movie")
VERB_PHRASES = {"get": "get", "search": "search for", "send": "send", "create": "create", "delete": "delete",
                "list": "list", "book": "book", "convert": "convert", "translate": "translate", "set": "set",
                "play": "play", "find": "find", "check": "check", "cancel": "cancel", "update": "update",
                "open": "open", "schedule": "schedule", "order": "order", "add": "add", "remove": "remove"}
PARAMS = {  # name -> schema; strings come from the request
    "city": {"type": "string"}, "query": {"type": "string"}, "name": {"type": "string"}, "title": {"type": "string"},
    "recipient": {"type": "string"}, "text": {"type": "string"}, "date": {"type": "string"},
    "location": {"type": "string"}, "topic": {"type": "string"}, "path": {"type": "string"},
    "count": {"type": "integer"}, "limit": {"type": "integer"}, "minutes": {"type": "integer"},
    "amount": {"type": "number"}, "urgent": {"type": "boolean"}, "public": {"type": "boolean"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "language": {"type": "string", "enum": ["english", "french", "german", "spanish"]},
    "priority": {"type": "string", "enum": ["low", "normal", "high"]},
}
STRING_PARAMS = tuple(k for k, v in PARAMS.items() if v["type"] == "string" and "enum" not in v)

JSON_ASKS = (
    "Give me {what} as JSON.", "Return a JSON object with {what}.", "Reply in JSON: {what}.",
    "As JSON, please: {what} for {topic}.", "Fill in {what} for {topic} and answer with JSON only.",
    "I need {what} about {topic}, formatted as a JSON object.", "{topic}: give {what} in JSON.",
    "Extract {what} from this: {topic}", "Make a record with {what}.", "Describe {topic} as JSON with {what}.",
)
ACTION_ASKS = (
    "Please {verb} the {obj} for {value}.", "Can you {verb} a {obj} with {param} {value}?",
    "I need you to {verb} my {obj}: {value}", "{Verb} the {obj} in {value}, thanks.",
    "Could you {verb} the {obj} called {value}?", "{Verb} {value} {obj} now.",
    "Hey, {verb} the {obj} for {value} please.", "Go ahead and {verb} the {obj}, {param} {value}.",
)
ANSWERS = ("Done: the {obj} is {value}.", "Here it is: {value}.", "The {obj} for {value} is ready.",
           "I did it. {Value}.", "OK, {value}.", "The result is {value}.")


@dataclass(frozen=True)
class WordPools:
    """Values to put into records and requests, from one split of the prepared corpora."""

    words: tuple[str, ...]
    phrases: tuple[str, ...]
    identifiers: tuple[str, ...]
    dialogue: tuple[tuple[str, str], ...]  # (line, reply) pairs for chit-chat

    @classmethod
    def from_corpora(cls, data_dir: Path, split: str, max_docs: int = 400) -> "WordPools":
        from build_engines.data.corpora.reader import iter_documents

        words: set[str] = set()
        phrases: list[str] = []
        identifiers: set[str] = set()
        dialogue: list[tuple[str, str]] = []
        for source in ("novels", "movie_dialog", "man_pages", "web_design", "stdlib_code"):
            for i, doc in enumerate(iter_documents(data_dir, source, split)):
                if i >= max_docs:
                    break
                words.update(w.lower() for w in re.findall(r"\b[A-Za-z][a-z]{2,10}\b", doc[:4000]))
                if source == "stdlib_code":
                    identifiers.update(re.findall(r"\bdef ([a-z_][a-z0-9_]{2,20})\(", doc))
                if source == "movie_dialog":
                    pairs = re.findall(r"A: ([^\n]{3,80})\nB: ([^\n]{2,80})", doc)
                    dialogue.extend(pairs)
                    phrases.extend(a for a, _ in pairs if 2 <= len(a.split()) <= 8)
        return cls(tuple(sorted(words)), tuple(phrases), tuple(sorted(identifiers)), tuple(dialogue))


def held_out_tool(verb: str, obj: str) -> bool:
    """A fixed quarter of the verb-object compositions that only the evaluation uses."""
    return zlib.crc32(f"{verb}_{obj}".encode()) % 4 == 0


class StructuredData:
    """Seeded generators of schemas, records, tools and the conversations that hold them."""

    def __init__(self, pools: WordPools, seed: int, held_out: bool = False, object_style_share: float = 0.0) -> None:
        self.pools = pools
        self.rng = random.Random(seed)
        self.style_rng = random.Random(seed + 1)  # separate: records and requests stay what this seed always made
        self.held_out = held_out  # True: the evaluation's tools (the held-out compositions)
        self.object_style_share = object_style_share  # of the JSON replies written in OBJECT_STYLE (else COMPACT)

    # ------------------------------------------------------------------ values
    def word(self) -> str:
        return self.rng.choice(self.pools.words)

    def text(self, long: bool = False) -> str:
        r = self.rng
        if not long and self.pools.phrases and r.random() < 0.3:
            return r.choice(self.pools.phrases)
        n = r.randint(4, 12) if long else r.choices((1, 2, 3), (5, 3, 2))[0]
        return " ".join(self.word() for _ in range(n))

    def number(self, integer: bool) -> int | float:
        r = self.rng
        magnitude = r.choice((10, 100, 1000, 100000))
        value = r.randint(0, magnitude)
        return value if integer else round(value / r.choice((10, 100)), r.choice((1, 2)))

    # ------------------------------------------------------------------ schemas and records
    def schema(self, depth: int = 0) -> dict:
        """An object schema: 1-5 properties of every JSON type, arrays with bounds, enums, nesting to depth 2."""
        r = self.rng
        keys = r.sample(FIELDS, r.randint(1, 5 if depth == 0 else 3))
        props: dict[str, dict] = {}
        for key in keys:
            kind = r.choices(("string", "long", "integer", "number", "boolean", "enum", "array", "object"),
                             (6, 1, 2, 1, 2, 2, 3, 2 if depth < 1 else 0))[0]
            if kind in ("string", "long"):
                props[key] = {"type": "string"}
            elif kind in ("integer", "number", "boolean"):
                props[key] = {"type": kind}
            elif kind == "enum":
                props[key] = {"type": "string", "enum": list(r.choice(ENUM_WORDS))}
            elif kind == "array":
                item = r.choice(({"type": "string"}, {"type": "string"}, {"type": "integer"}))
                low = r.randint(0, 2)
                props[key] = {"type": "array", "items": item, "minItems": low, "maxItems": low + r.randint(1, 3)}
            else:
                props[key] = self.schema(depth + 1)
        required = keys if r.random() < 0.7 else [k for k in keys if r.random() < 0.6] or keys[:1]
        return {"type": "object", "properties": props, "required": list(required)}

    def record(self, schema: dict) -> Any:
        """A value valid under `schema`; optional properties appear about half the time."""
        r = self.rng
        kind = schema.get("type")
        if "enum" in schema:
            return r.choice(schema["enum"])
        if kind == "object":
            required = set(schema.get("required", []))
            return {k: self.record(s) for k, s in schema.get("properties", {}).items()
                    if k in required or r.random() < 0.5}
        if kind == "array":
            n = r.randint(schema.get("minItems", 0), schema.get("maxItems", 4))
            return [self.record(schema["items"]) for _ in range(n)]
        if kind == "string":
            return self.text(long=r.random() < 0.15)
        if kind in ("integer", "number"):
            return self.number(kind == "integer")
        if kind == "boolean":
            return r.random() < 0.5
        raise ValueError(f"no record for schema {schema}")

    def json_request(self, schema: dict) -> str:
        """A user's request for a record of `schema` (it names the fields; the schema itself stays off the prompt,
        as with response_format)."""
        r = self.rng
        keys = list(schema["properties"])
        what = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]
        if r.random() < 0.5:
            what = "the " + what
        return r.choice(JSON_ASKS).format(what=what, topic=self.text())

    def json_exchange(self) -> tuple[dict, list[dict]]:
        """(schema, [user, assistant]) with the assistant's reply the record in JSON: COMPACT, or OBJECT_STYLE for
        `object_style_share` of them."""
        schema = self.schema()
        style = OBJECT_STYLE if self.style_rng.random() < self.object_style_share else COMPACT
        reply = json.dumps(self.record(schema), ensure_ascii=False, separators=style)
        return schema, [{"role": "user", "content": self.json_request(schema)},
                        {"role": "assistant", "content": reply}]

    # ------------------------------------------------------------------ tools
    def tool(self) -> dict:
        """A function tool in OpenAI's shape, named verb_object, with 1-3 parameters."""
        r = self.rng
        while True:
            verb, obj = r.choice(VERBS), r.choice(OBJECTS)
            if held_out_tool(verb, obj) == self.held_out:
                break
        names = r.sample(list(PARAMS), r.randint(1, 3))
        if not any(n in STRING_PARAMS for n in names):
            names[0] = r.choice(STRING_PARAMS)
        params = {n: dict(PARAMS[n]) for n in names}
        required = [n for n in names if n in STRING_PARAMS or r.random() < 0.5]
        return {"type": "function", "function": {
            "name": f"{verb}_{obj}", "description": f"{VERB_PHRASES[verb].capitalize()} a {obj}.",
            "parameters": {"type": "object", "properties": params, "required": required}}}

    def arguments(self, tool: dict) -> dict:
        params = tool["function"]["parameters"]
        required = set(params["required"])
        return {n: self.record(s) for n, s in params["properties"].items() if n in required or self.rng.random() < 0.4}

    def action_request(self, tool: dict, args: dict) -> str:
        """A request to use `tool`, holding its first string argument's value verbatim."""
        verb, obj = tool["function"]["name"].split("_", 1)
        param, value = next(((k, v) for k, v in args.items() if isinstance(v, str) and k in STRING_PARAMS),
                            ("name", self.text()))
        phrase = VERB_PHRASES[verb]
        return self.rng.choice(ACTION_ASKS).format(verb=phrase, Verb=phrase.capitalize(), obj=obj, param=param,
                                                   value=value)

    def tools(self, n: int | None = None) -> list[dict]:
        chosen: dict[str, dict] = {}
        for _ in range(n or self.rng.randint(1, 3)):
            t = self.tool()
            chosen.setdefault(t["function"]["name"], t)
        return list(chosen.values())

    def tool_conversation(self) -> tuple[list[dict], list[dict]]:
        """(tools, messages): an action request, the call, its result, a short answer."""
        tools = self.tools()
        tool = self.rng.choice(tools)
        args = self.arguments(tool)
        request = self.action_request(tool, args)
        call = {"id": "call_0", "type": "function",
                "function": {"name": tool["function"]["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
        value = self.text()
        result = json.dumps({"result": value}, ensure_ascii=False)
        obj = tool["function"]["name"].split("_", 1)[1]
        answer = self.rng.choice(ANSWERS).format(obj=obj, value=value, Value=value.capitalize())
        return tools, [{"role": "user", "content": request},
                       {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_0", "content": result},
                       {"role": "assistant", "content": answer}]

    def chit_chat(self) -> tuple[list[dict], list[dict]]:
        """(tools, messages): tools offered, a remark that asks for no action, a plain reply."""
        line, reply = self.rng.choice(self.pools.dialogue)
        return self.tools(), [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]

    # ------------------------------------------------------------------ JSON in code and CSS
    def code_document(self) -> str:
        """Python that writes or reads JSON (dicts with the same keys and values a record has)."""
        r = self.rng
        record = self.record(self.schema())
        text = json.dumps(record, ensure_ascii=False, separators=r.choice((COMPACT, (", ", ": "))))
        name = r.choice(self.pools.identifiers) if self.pools.identifiers else self.word()
        return r.choice((
            f"import json\n\n\ndef {name}():\n    return json.loads({text!r})\n",
            f"import json\n\n{name.upper()} = {text}\n\nprint(json.dumps({name.upper()}))\n",
            f"def {name}(path):\n    with open(path) as f:\n        data = json.load(f)\n    assert data == {text}\n",
        ))

    def css_document(self) -> str:
        """Web-design files that carry JSON: a package manifest, JSON-LD in a page, a data attribute."""
        r = self.rng
        record = self.record(self.schema())
        text = json.dumps(record, ensure_ascii=False, separators=(", ", ": "))
        word = self.word()
        return r.choice((
            json.dumps({"name": word, "version": f"{r.randint(0, 9)}.{r.randint(0, 20)}.{r.randint(0, 9)}",
                        "style": f"dist/{word}.css", "keywords": [self.word() for _ in range(r.randint(1, 4))]},
                       indent=2),
            f'<script type="application/ld+json">{text}</script>\n<div class="{word}"></div>\n',
            f"<div class=\"{word}\" data-options='{text}'></div>\n"
            f"<style>\n.{word} {{ color: {r.choice(ENUM_WORDS[1])}; }}\n</style>\n",
        ))


# ---------------------------------------------------------------------------------------------------- streams
KINDS = ("json", "tools", "chit_chat", "code", "css")


def conversations(data: StructuredData, kind: str, n: int) -> Iterator[tuple[list[dict] | None, list[dict] | str]]:
    """n items of one kind: (tools, messages) for conversations, (None, text) for documents."""
    for _ in range(n):
        if kind == "json":
            yield None, data.json_exchange()[1]
        elif kind == "tools":
            yield data.tool_conversation()
        elif kind == "chit_chat":
            yield data.chit_chat()
        elif kind == "code":
            yield None, data.code_document()
        elif kind == "css":
            yield None, data.css_document()
        else:
            raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
