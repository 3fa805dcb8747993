"""Issue 32: the sampler's top_k / min_p / logit_bias / min_tokens / ignore_eos, their validation, and structured
outputs (grammar specs, the compiled-grammar cache, the batched bitmask), then the same on the embedded default in
process: schema-valid JSON from a model that otherwise writes noise, whatever the adapter."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ced.text.tokenizer import ChatTokenizer
from tests.conftest import EMBEDDED
from tritonserver_backend.errors import BadRequest
from tritonserver_backend.sampling.grammar import GrammarCache, allowed_tokens, canonical
from tritonserver_backend.sampling.params import parse_logit_bias
from tritonserver_backend.sampling.sampler import Sampler, SamplingParams, filter_probs

EOT = 6


# ------------------------------------------------------------------------------------------------ the sampler
def test_top_k_one_is_greedy_whatever_the_seed_and_temperature(seed: int) -> None:
    for i in range(20):
        logits = torch.randn(300)
        greedy = Sampler(SamplingParams())(logits)
        assert Sampler(SamplingParams(temperature=1.5, top_k=1, seed=seed + i))(logits) == greedy


def test_top_k_and_min_p_keep_only_their_tokens(seed: int) -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    drawn = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s))(logits) for s in range(200)}
    assert drawn == {0, 1}
    drawn = {Sampler(SamplingParams(temperature=1.0, min_p=0.25, seed=s))(logits) for s in range(200)}
    assert drawn == {0, 1, 2}, "0.15 >= 0.25 x 0.5 stays, 0.05 does not"
    probs = filter_probs(torch.tensor([0.5, 0.3, 0.15, 0.05]), 2, 0.0)
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_nothing_set_leaves_the_seeded_draws_as_they_were(seed: int) -> None:
    """top_k 0 / -1 and min_p 0 are off: a seeded reply draws exactly what it drew before they existed."""
    logits = torch.randn(500)
    for params in (SamplingParams(temperature=0.8, top_p=0.9, seed=seed),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=seed, top_k=-1)):
        a, b = Sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=seed)), Sampler(params)
        assert [a(logits) for _ in range(30)] == [b(logits) for _ in range(30)]


def test_logit_bias_forces_and_bans_a_token() -> None:
    logits = torch.tensor([3.0, 1.0, 0.0, -2.0])
    assert Sampler(SamplingParams(logit_bias=((3, 100.0),)))(logits) == 3
    assert Sampler(SamplingParams(logit_bias=((0, -100.0),)))(logits) == 1
    assert Sampler(SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0))))(logits) in (2, 3)
    assert torch.equal(logits, torch.tensor([3.0, 1.0, 0.0, -2.0])), "the engine's logits stay untouched"


def test_min_tokens_masks_end_of_turn_and_stop_ids_then_lets_them_through() -> None:
    logits = torch.zeros(10)
    logits[EOT], logits[8], logits[4] = 5.0, 4.0, 1.0
    sampler = Sampler(SamplingParams(min_tokens=2, stop_token_ids=(8,)), EOT)
    assert sampler(logits, []) == 4 and sampler(logits, [4]) == 4
    assert sampler(logits, [4, 4]) == EOT
    ignore = Sampler(SamplingParams(ignore_eos=True), EOT)
    assert all(ignore(logits, [1] * n) == 8 for n in range(5)), "ignore_eos: end-of-turn never, whatever the length"


@pytest.mark.parametrize("kwargs", [dict(top_k=-2), dict(min_p=1.5), dict(min_p=-0.1), dict(logit_bias=((1, 101.0),)),
                                    dict(logit_bias=((-1, 1.0),)), dict(stop_token_ids=(-3,)), dict(min_tokens=65),
                                    dict(min_tokens=-1), dict(grammar='{"type":"json_object"}', ignore_eos=True),
                                    dict(grammar='{"type":"json_object"}', min_tokens=2)])
def test_out_of_range_values_are_bad_requests(kwargs: dict) -> None:
    with pytest.raises(BadRequest):
        SamplingParams(**kwargs)


def test_logit_bias_json_and_vocabulary_checks() -> None:
    assert parse_logit_bias('{"42": -100, "7": 2.5}') == ((7, 2.5), (42, -100.0))
    assert parse_logit_bias("") == ()
    for bad in ('[1]', '{"x": 1}', '{"1": "a"}', '{"1": true}', "{"):
        with pytest.raises(BadRequest):
            parse_logit_bias(bad)
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        SamplingParams(logit_bias=((9000, 1.0),)).check_vocab(8192)
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        SamplingParams(stop_token_ids=(8192,)).check_vocab(8192)


# ------------------------------------------------------------------------------------------------ grammars
def test_specs_are_checked_and_canonical() -> None:
    assert (canonical('{"schema": {"type": "object"}, "type": "json_schema"}')
            == canonical('{"type":"json_schema","schema":{"type":"object"}}'))
    # a schema's own key order is kept: its properties are written in that order
    assert (canonical('{"type":"json_schema","schema":{"properties":{"b":{},"a":{}}}}')
            != canonical('{"type":"json_schema","schema":{"properties":{"a":{},"b":{}}}}'))
    assert canonical("") == ""
    for bad in ('{"type":"xml"}', '{"type":"regex"}', '{"type":"regex","pattern":""}',
                '{"type":"json_schema","schema":[]}', '{"type":"json_object","schema":{}}', "[]", "not json"):
        with pytest.raises(BadRequest):
            canonical(bad)


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.load(EMBEDDED)


def test_the_cache_compiles_once_per_spec_and_forgets_the_oldest(tokenizer: ChatTokenizer) -> None:
    cache = GrammarCache(tokenizer, capacity=2)
    specs = [canonical(json.dumps({"type": "regex", "pattern": p})) for p in ("a+", "b+", "c+")]
    first = cache.compile(specs[0])
    assert cache.compile(specs[0]) is first and (cache.hits, cache.misses) == (1, 1)
    cache.compile(specs[1])
    cache.compile(specs[2])
    assert len(cache) == 2 and cache.compile(specs[0]) is not first and cache.misses == 4


@pytest.mark.parametrize("spec", ['{"type":"regex","pattern":"([a-"}',
                                  '{"type":"json_schema","schema":{"type":"nonsense"}}',
                                  '{"type":"ebnf","grammar":"root ::= undefined_rule"}'])
def test_a_grammar_that_does_not_compile_is_a_bad_request(tokenizer: ChatTokenizer, spec: str) -> None:
    with pytest.raises(BadRequest, match="does not compile"):
        GrammarCache(tokenizer).compile(canonical(spec))


def test_a_schema_writes_its_properties_in_the_order_the_client_gave(tokenizer: ChatTokenizer) -> None:
    """As OpenAI's structured outputs do: {"zeta", "alpha"} is written zeta first (a sorted cache key once made every
    reply alphabetical, which no client asked for)."""
    schema = {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"]}
    cache = GrammarCache(tokenizer)

    def accepts(text: str) -> bool:
        matcher = cache.matcher(canonical(json.dumps({"type": "json_schema", "schema": schema})))
        return all(matcher.accept_token(t) for t in tokenizer.encode(text)) and matcher.accept_token(
            tokenizer.end_of_turn_id)

    assert accepts('{"zeta":"x","alpha":1}')
    assert not accepts('{"alpha":1,"zeta":"x"}')


def test_a_structural_tag_leaves_text_free_and_holds_a_begun_call(tokenizer: ChatTokenizer) -> None:
    """tool_choice auto's grammar (`JsonTagSyntax.auto_format`): any text, or a call of an offered tool with valid
    arguments; a call of another name, broken arguments or an unclosed call are refused; first_only admits one call."""
    from ced.text.tool_parsers import JsonTagSyntax

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}
    cache = GrammarCache(tokenizer)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'

    def accepts(text: str, first_only: bool = False) -> bool:
        spec = canonical(json.dumps({"type": "structural_tag",
                                     "format": JsonTagSyntax().auto_format([tool], first_only)}))
        matcher = cache.matcher(spec)
        return all(matcher.accept_token(t) for t in tokenizer.encode(text)) and matcher.accept_token(
            tokenizer.end_of_turn_id)

    assert accepts("It is sunny, no call needed.")
    assert accepts("Let me look. " + call) and accepts(call + call)
    assert not accepts(call + call, first_only=True)
    assert not accepts(call.replace("get_weather", "get_news"))
    assert not accepts(call.replace('"days": 2', '"days": "two"'))
    assert not accepts(call.removesuffix("</tool_call>"))
    with pytest.raises(BadRequest, match="structural_tag"):
        canonical('{"type": "structural_tag", "format": "triggered"}')


def test_the_batched_mask_allows_what_each_grammar_allows(tokenizer: ChatTokenizer) -> None:
    cache = GrammarCache(tokenizer)
    json_object = cache.matcher(canonical('{"type":"json_object"}'))
    choice = cache.matcher(canonical('{"type":"ebnf","grammar":"root ::= \\"yes\\" | \\"no\\""}'))
    masks = allowed_tokens([json_object, choice], tokenizer.vocab_size)
    assert masks.shape == (2, tokenizer.vocab_size) and masks.dtype == torch.bool
    assert all(tokenizer.decode([t]).startswith("{") for t in torch.nonzero(masks[0]).reshape(-1).tolist())
    assert ({tokenizer.decode([t]) for t in torch.nonzero(masks[1]).reshape(-1).tolist()}
            <= {"y", "ye", "yes", "n", "no"})
    assert not masks[:, tokenizer.end_of_turn_id].any(), "end-of-turn only where the grammar is complete"
    for t in tokenizer.encode("yes"):
        assert choice.accept_token(t)
    done = allowed_tokens([choice], tokenizer.vocab_size)[0]
    assert torch.nonzero(done).reshape(-1).tolist() == [tokenizer.end_of_turn_id]


def test_the_mask_makes_any_logits_follow_the_grammar(tokenizer: ChatTokenizer, seed: int) -> None:
    """Random logits (the worst model there is), sampled under a schema's mask token by token: valid JSON."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50},
                                               "tag": {"enum": ["x", "y"]}}, "required": ["n", "tag"],
              "additionalProperties": False}
    matcher = GrammarCache(tokenizer).matcher(canonical(json.dumps({"type": "json_schema", "schema": schema})))
    sampler, out = Sampler(SamplingParams(temperature=1.0, seed=seed), tokenizer.end_of_turn_id), []
    for _ in range(100):
        token = sampler(torch.randn(tokenizer.vocab_size), out, allowed_tokens([matcher], tokenizer.vocab_size)[0])
        assert matcher.accept_token(token)
        if token == tokenizer.end_of_turn_id:
            break
        out.append(token)
    jsonschema.validate(json.loads(tokenizer.decode(out)), schema)


# ------------------------------------------------------------------------------------------------ in process
SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["name", "address"],
               "properties": {"name": {"type": "string", "maxLength": 12},
                              "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                          "properties": {"city": {"type": "string", "maxLength": 10},
                                                         "zip": {"type": "integer", "minimum": 0, "maximum": 99999}}}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
             "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["items"],
              "properties": {"items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                       "minItems": 1, "maxItems": 4}}},
}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    from tests.tritonserver_backend.in_process import onnx_pipeline

    return onnx_pipeline(tmp_path_factory, default_engines)


def _chat(pipeline, text: str, adapter: str | None = None, **params):  # type: ignore[no-untyped-def]
    import uuid

    return pipeline.chat(f"g-{uuid.uuid4().hex}", text, adapter=adapter, new_session=True,
                         params=SamplingParams(**params))


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [None, "base", "L0_chat", "L1_agent", "L2_code", "L3_design"])
def test_every_schema_gives_valid_json_under_every_adapter(pipeline, adapter) -> None:  # type: ignore[no-untyped-def]
    for name, schema in SCHEMAS.items():
        reply = _chat(pipeline, "Describe a person as JSON", adapter, max_tokens=200,
                      grammar=canonical(json.dumps({"type": "json_schema", "schema": schema})))
        assert reply.finish_reason == "end_of_turn", (name, reply.text)
        jsonschema.validate(json.loads(reply.text), schema)


@pytest.mark.slow
def test_json_object_regex_and_ebnf(pipeline) -> None:  # type: ignore[no-untyped-def]
    """json_object bounds nothing, and the default greedily writes one endless string; sampled (or penalised) it
    closes."""
    reply = _chat(pipeline, "JSON please", max_tokens=300, temperature=1.0, seed=1,
                  grammar=canonical('{"type":"json_object"}'))
    assert reply.finish_reason == "end_of_turn" and isinstance(json.loads(reply.text), dict), reply.text
    reply = _chat(pipeline, "JSON please", "L3_design", max_tokens=300, presence_penalty=2.0, frequency_penalty=2.0,
                  grammar=canonical('{"type":"json_object"}'))
    assert reply.finish_reason == "end_of_turn" and isinstance(json.loads(reply.text), dict), reply.text
    reply = _chat(pipeline, "A plate number", max_tokens=20,
                  grammar=canonical('{"type":"regex","pattern":"[A-Z]{2}-[0-9]{3}"}'))
    assert reply.finish_reason == "end_of_turn" and len(reply.text) == 6 and reply.text[2] == "-", reply.text
    reply = _chat(pipeline, "Yes or no?", "L2_code", max_tokens=20,
                  grammar=canonical('{"type":"ebnf","grammar":"root ::= \\"yes\\" | \\"no\\""}'))
    assert reply.text in ("yes", "no") and reply.finish_reason == "end_of_turn"


@pytest.mark.slow
def test_sampling_options_on_the_model(pipeline, tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "How do I center a div?"
    greedy = _chat(pipeline, text, "L3_design", max_tokens=12)
    assert _chat(pipeline, text, "L3_design", max_tokens=12, temperature=1.3, seed=5,
                 top_k=1).token_ids == greedy.token_ids
    forced = tokenizer.encode("{")[0]
    biased = _chat(pipeline, text, "L3_design", max_tokens=5, logit_bias=((forced, 100.0),))
    assert biased.token_ids == [forced] * 5 and biased.finish_reason == "length"
    # stop_token_ids: the reply ends where greedy first writes one of them, without it
    k = next(i for i, t in enumerate(greedy.token_ids) if i and t not in greedy.token_ids[:i])
    stopped = _chat(pipeline, text, "L3_design", max_tokens=12, stop_token_ids=(greedy.token_ids[k], 7))
    assert stopped.token_ids == greedy.token_ids[:k] and stopped.finish_reason == "stop"
    # min_tokens and ignore_eos against a reply that wants to end at once (end-of-turn biased up)
    eot = ((tokenizer.end_of_turn_id, 100.0),)
    assert _chat(pipeline, text, None, max_tokens=8, logit_bias=eot).token_ids == []
    at_least = _chat(pipeline, text, None, max_tokens=8, logit_bias=eot, min_tokens=3)
    assert len(at_least.token_ids) == 3 and at_least.finish_reason == "end_of_turn"
    ignored = _chat(pipeline, text, None, max_tokens=8, logit_bias=eot, ignore_eos=True)
    assert len(ignored.token_ids) == 8 and ignored.finish_reason == "length"
