"""The structured training data: records valid under their schemas, in the very text the server's grammars admit, tool
conversations in the default's chat format, and evaluation tools kept out of training."""

from __future__ import annotations

import json

import jsonschema
import pytest

from build_engines.training.structured_data import (
    COMPACT,
    KINDS,
    OBJECT_STYLE,
    StructuredData,
    WordPools,
    conversations,
    held_out_tool,
)
from ced.text.chat_format import ChatFormat
from ced.text.tokenizer import ChatTokenizer
from ced.text.tool_parsers import syntax_of
from tests.conftest import EMBEDDED

POOLS = WordPools(
    words=("river", "stone", "lamp", "quiet", "orange", "window", "paper", "silver", "garden", "north"),
    phrases=("see you in the morning", "where are you going"),
    identifiers=("read_config", "open_file"),
    dialogue=(("how was the party?", "loud, as always."), ("did you call him?", "not yet.")),
)


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_every_record_is_valid_under_its_schema_and_written_in_a_served_style(share: float) -> None:
    """Compact (json_schema's grammar) or, for `object_style_share` of them, json_object's ", " between members."""
    data = StructuredData(POOLS, seed=3, object_style_share=share)
    styles = []
    for _ in range(300):
        schema, messages = data.json_exchange()
        reply = messages[1]["content"]
        jsonschema.validate(json.loads(reply), schema)
        style = next(s for s in (COMPACT, OBJECT_STYLE)
                     if reply == json.dumps(json.loads(reply), ensure_ascii=False, separators=s))
        styles.append(style)
        assert all(key in messages[0]["content"] for key in schema["properties"])  # the request names the fields
    written = [s for s in styles if s == OBJECT_STYLE]  # a record of one flat member is the same in both: compact
    assert (100 < len(written) < 200) if share else not written


def test_the_reply_style_leaves_the_records_and_requests_of_a_seed_as_they_were() -> None:
    """The style has its own random stream: the evaluation's held-out schemas, made from the same generator, stay
    the same cases before and after the style was added."""
    data = StructuredData(POOLS, seed=8)
    again = StructuredData(POOLS, seed=8, object_style_share=0.5)
    for _ in range(50):
        (schema, messages), (schema_again, messages_again) = data.json_exchange(), again.json_exchange()
        assert schema == schema_again and messages[0] == messages_again[0]
        assert json.loads(messages[1]["content"]) == json.loads(messages_again[1]["content"])


def test_the_server_grammar_admits_each_training_reply_token_by_token() -> None:
    """The replies are tokenized as the model will be asked to write them: the sampler's json_schema grammar
    (compact separators) accepts every token of a compact reply and then the end of the turn, its json_object grammar
    every token of a reply in OBJECT_STYLE."""
    from tritonserver_backend.sampling.grammar import GrammarCache, canonical

    tok = ChatTokenizer.load(EMBEDDED)
    cache = GrammarCache(tok)
    data = StructuredData(POOLS, seed=4, object_style_share=0.5)
    for _ in range(25):
        schema, messages = data.json_exchange()
        reply = messages[1]["content"]
        compact = reply == json.dumps(json.loads(reply), ensure_ascii=False, separators=COMPACT)
        spec = {"type": "json_schema", "schema": schema} if compact else {"type": "json_object"}
        matcher = cache.matcher(canonical(json.dumps(spec)))
        for token in tok.encode(reply):
            assert matcher.accept_token(token), (schema, messages[1]["content"])
        assert matcher.accept_token(tok.end_of_turn_id)


def test_a_tool_conversation_renders_in_the_default_format_and_its_call_parses_back() -> None:
    fmt = ChatFormat.load(EMBEDDED)
    data = StructuredData(POOLS, seed=5)
    for _ in range(40):
        tools, messages = data.tool_conversation()
        text = fmt.render(messages, add_generation_prompt=False, tools=tools)
        reply = text.split("<|assistant|>")[1].split("<|end|>")[0]
        _, calls = syntax_of(fmt).parse(reply)
        assert len(calls) == 1
        call = messages[1]["tool_calls"][0]["function"]
        assert calls[0].name == call["name"]
        arguments = json.loads(calls[0].arguments)
        schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call["name"])
        jsonschema.validate(arguments, schema)
        strings = [v for v in arguments.values() if isinstance(v, str) and v not in ("celsius", "fahrenheit")]
        assert not strings or any(v in messages[0]["content"] for v in strings)  # the value comes from the request


def test_evaluation_tools_are_compositions_training_never_draws() -> None:
    train = StructuredData(POOLS, seed=6)
    held = StructuredData(POOLS, seed=6, held_out=True)
    train_names = {t["function"]["name"] for _ in range(200) for t in train.tools()}
    held_names = {t["function"]["name"] for _ in range(200) for t in held.tools()}
    assert train_names and held_names and not train_names & held_names
    assert all(held_out_tool(*n.split("_", 1)) for n in held_names)


def test_chit_chat_offers_tools_and_answers_without_a_call() -> None:
    tools, messages = StructuredData(POOLS, seed=7).chit_chat()
    assert tools and "tool_calls" not in messages[1]
    assert (messages[0]["content"], messages[1]["content"]) in POOLS.dialogue


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_seeded(kind: str) -> None:
    first = list(conversations(StructuredData(POOLS, seed=8), kind, 5))
    again = list(conversations(StructuredData(POOLS, seed=8), kind, 5))
    other = list(conversations(StructuredData(POOLS, seed=9), kind, 5))
    assert first == again and first != other


def test_code_and_css_documents_carry_parseable_json() -> None:
    data = StructuredData(POOLS, seed=10)
    for _ in range(30):
        css = data.css_document()
        start, end = css.index("{"), css.rindex("}") + 1
        if "<style>" in css:
            end = css.index("'></div>")
        assert isinstance(json.loads(css[start:end]), dict)
        assert "json" in data.code_document()
