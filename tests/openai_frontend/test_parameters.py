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
    return ChatRequest.parse(json.dumps({"model": "mol2", "messages": [{"role": "user", "content": "hi"}], **body}).encode())


@pytest.mark.parametrize("body,param", [
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}), "response_format"),
    (dict(logit_bias={"42": 5}), "logit_bias"),
    (dict(top_k=5), "top_k"),
    (dict(min_p=0.1), "min_p"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(guided_json={"type": "object"}), "guided_json"),
    (dict(stop_token_ids=[3]), "stop_token_ids"),
    (dict(ignore_eos=True), "ignore_eos"),
    (dict(min_tokens=4), "min_tokens"),
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
        _parse(top_k=5, min_p=0.2, response_format={"type": "json_object"})
    assert all(p in info.value.message for p in ("top_k", "min_p", "response_format"))


@pytest.mark.parametrize("body", [
    dict(n=1, logprobs=False, top_logprobs=0, logit_bias={}, tools=[], tool_choice="none", response_format={"type": "text"},
         top_k=-1, min_p=0, stop_token_ids=[], ignore_eos=False, min_tokens=0, store=False, echo=False),
    dict(user="u-1", metadata={"k": "v"}, safety_identifier="s", prompt_cache_key="c", parallel_tool_calls=True),
    dict(top_k=None, response_format=None, logprobs=None, tools=None),
    dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5, seed=1, top_p=0.9, temperature=0.7),
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
