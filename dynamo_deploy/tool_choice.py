"""Tools through Dynamo's OpenAI frontend, written the way the model writes calls.

The frontend renders the offered tools into the prompt with our chat template (tokenizer_files.py), reads calls out of
the reply with the parser the model card names (`ModelRuntimeConfig.tool_call_parser`), and, with its structural-tag
policy on, constrains `tool_choice` by sending the worker an xgrammar structural tag in
`sampling_options.guided_decoding.structural_tag` (measured on ai-dynamo 1.6.1): `triggered_tags` on `<tool_call>`,
one tag per allowed tool whose `begin` is the parser's own opening (hermes: `<tool_call>\\n{"name": "NAME",
"arguments": `) with the tool's parameters schema as content; `at_least_one` is true for "required" and a named
function (then only that tool's tag), false for "auto"; `stop_after_first` follows `parallel_tool_calls` false.

Hermes puts newlines around the JSON that the default never saw in training, so the worker does not enforce that tag
as sent: it reads which tools are allowed and whether a call is forced, and enforces the Triton path's constraints in
the model's own syntax (ced.text.tool_parsers): a forced call is `ToolSyntax.grammar` (exactly one call of one of the
allowed tools), auto is `ToolSyntax.auto_format` (free text until the model opens a call, then a valid call of an
offered tool). The hermes parser reads the default's calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
no newlines) as they are, so the client gets the same calls as from the project's OpenAI frontend, token for token.
Without the policy (a card registered otherwise) the frontend sends a JSON schema for forced choices instead, and the
reply is the bare arguments object, which the frontend wraps into the named call itself.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from ced.text.tool_parsers import JsonTagSyntax, ToolSchemaError, ToolSyntax
from tritonserver_backend.errors import BadRequest

# the frontend's parser for each syntax the model may write calls in (None: the frontend cannot read that syntax)
PARSER_OF_SYNTAX = {JsonTagSyntax.name: "hermes"}
# the card's structural-tag policy: every tool_choice but "none" arrives as a structural tag (auto included)
STRUCTURAL_TAG_POLICY = {"scope": "always"}
# hermes's tag opening, the tool's name as a JSON string in the middle
_HERMES_BEGIN = re.compile(r'<tool_call>\s*\{"name":\s*("(?:[^"\\]|\\.)*"),\s*"arguments":\s*', re.DOTALL)


def parser_for(syntax: ToolSyntax | None) -> str | None:
    return PARSER_OF_SYNTAX.get(syntax.name) if syntax is not None else None


def tool_call_tag(tag: Mapping[str, Any]) -> tuple[list[dict], bool, bool] | None:
    """Dynamo's tool-call structural tag -> (the allowed tools as OpenAI function objects, a call is forced, at most
    one call); None when `tag` is another structural tag (a client's own, enforced as sent)."""
    fmt = tag.get("format") if isinstance(tag, Mapping) else None
    if not isinstance(fmt, Mapping) or fmt.get("type") != "triggered_tags":
        return None
    tags = fmt.get("tags")
    if not isinstance(tags, list) or not tags:
        return None
    tools = []
    for t in tags:
        begin = _HERMES_BEGIN.fullmatch(str(t.get("begin", ""))) if isinstance(t, Mapping) else None
        content = t.get("content") if isinstance(t, Mapping) else None
        if begin is None or not isinstance(content, Mapping) or content.get("type") != "json_schema":
            return None
        tools.append({"name": json.loads(begin.group(1)), "parameters": content.get("json_schema")})
    return tools, bool(fmt.get("at_least_one")), bool(fmt.get("stop_after_first"))


def native_constraint(tools: list[dict], forced: bool, first_only: bool, syntax: ToolSyntax | None) -> dict | None:
    """Our grammar spec for a tool-call tag's content (`tool_call_tag`) in the model's own syntax (module docstring);
    None for auto when a schema is outside what the grammar enforces (the reply is then parsed as written, as on the
    Triton path). BadRequest for a forced call the grammar cannot enforce (the Triton path's 400)."""
    if syntax is None:
        raise BadRequest("this model's chat format writes no tool-call syntax the workers can constrain, so it cannot "
                         "take tool_choice")
    try:
        if forced:
            return {"type": "ebnf", "grammar": syntax.grammar(tools)}
        fmt = syntax.auto_format(tools, first_only=first_only)
    except ToolSchemaError as exc:
        if forced:
            raise BadRequest(f"tool_choice: {exc}") from None
        return None
    return {"type": "structural_tag", "format": fmt} if fmt is not None else None
