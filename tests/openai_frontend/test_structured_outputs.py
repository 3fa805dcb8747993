"""Issue 32 through the real `openai` client: response_format (json_schema, json_object), vLLM's guided_* and
structured_outputs, and the sampling extensions (top_k, min_p, logit_bias, stop_token_ids, min_tokens, ignore_eos),
streamed and not, on the real server; what is still refused is a 400."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.tritonserver_backend.test_sampling_grammar import SCHEMAS

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Describe yourself as JSON."}]
EOT = 6


def _reply(client, model: str, stream: bool, messages=None, **kwargs) -> tuple[str, str, str]:  # type: ignore[no-untyped-def]
    """(text, finish_reason, adapter) of one completion, streamed or not."""
    messages = messages or USER
    if not stream:
        done = client.chat.completions.create(model=model, messages=messages, **kwargs)
        return done.choices[0].message.content, done.choices[0].finish_reason, done.model_extra.get("adapter", "")
    text, finish, adapter = [], "", ""
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **kwargs):
        adapter = (chunk.model_extra or {}).get("adapter", adapter)
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, adapter


@pytest.mark.parametrize("model", ["mol2", "mol2:L2_code", "mol2:L0_chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_is_valid_json_for_every_schema(client, model: str, stream: bool) -> None:  # type: ignore[no-untyped-def]
    for name, schema in SCHEMAS.items():
        response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        text, finish, _ = _reply(client, model, stream, max_tokens=200, response_format=response_format)
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_vllms_structured_output_names(client, stream: bool) -> None:  # type: ignore[no-untyped-def]
    schema = SCHEMAS["enum"]
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        text, finish, _ = _reply(client, "mol2", stream, max_tokens=100, extra_body=extra)
        jsonschema.validate(json.loads(text), schema)
        assert finish == "stop"
    text, _, _ = _reply(client, "mol2:L3_design", stream, max_tokens=20,
                        extra_body={"guided_regex": "[a-z]{3}-[0-9]{2}"})
    assert len(text) == 6 and text[3] == "-" and text[:3].isalpha() and text[4:].isdigit(), text
    for extra in ({"guided_choice": ["yes", "no", "maybe"]}, {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                  {"guided_grammar": 'root ::= "yes" | "no" | "maybe"'}):
        text, finish, _ = _reply(client, "mol2", stream, max_tokens=20, extra_body=extra)
        assert text in ("yes", "no", "maybe") and finish == "stop", (extra, text)


def test_json_object_is_a_json_object(client) -> None:  # type: ignore[no-untyped-def]
    """json_object bounds nothing and the default writes one endless string when greedy: penalised, it closes."""
    for stream in (False, True):
        text, finish, _ = _reply(client, "mol2:L3_design", stream, max_tokens=400,
                                 response_format={"type": "json_object"}, presence_penalty=2.0, frequency_penalty=2.0)
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
        else:  # cut by max_tokens: an unfinished object, never anything else
            assert finish == "length" and text.startswith("{"), text


def test_sampling_extensions(client, tokenizer) -> None:  # type: ignore[no-untyped-def]
    kwargs = dict(model="mol2:L3_design", messages=[{"role": "user", "content": "How do I center a div?"}],
                  max_tokens=10)
    greedy = client.chat.completions.create(**kwargs).choices[0].message.content
    top1 = client.chat.completions.create(**kwargs, temperature=1.3, seed=3,
                                          extra_body={"top_k": 1}).choices[0].message.content
    assert top1 == greedy
    sampled = client.chat.completions.create(**kwargs, temperature=1.0, seed=3, extra_body={"top_k": 40, "min_p": 0.05})
    assert sampled.choices[0].finish_reason in ("stop", "length")
    brace = tokenizer.encode("{")[0]
    forced = client.chat.completions.create(**{**kwargs, "max_tokens": 4}, logit_bias={str(brace): 100})
    assert forced.choices[0].message.content == "{" * 4 and forced.usage.completion_tokens == 4
    # stop_token_ids: the forced token ends the reply at once; with min_tokens it is masked for the first two
    stopped = client.chat.completions.create(**kwargs, logit_bias={str(brace): 100},
                                             extra_body={"stop_token_ids": [brace]})
    assert stopped.usage.completion_tokens == 0 and stopped.choices[0].finish_reason == "stop"
    later = client.chat.completions.create(**kwargs, logit_bias={str(brace): 100},
                                           extra_body={"stop_token_ids": [brace], "min_tokens": 2})
    assert (later.usage.completion_tokens == 2 and "{" not in later.choices[0].message.content
            and later.choices[0].finish_reason == "stop")
    eot = {str(EOT): 100}
    assert client.chat.completions.create(**kwargs, logit_bias=eot).usage.completion_tokens == 0
    at_least = client.chat.completions.create(**kwargs, logit_bias=eot, extra_body={"min_tokens": 3})
    assert at_least.usage.completion_tokens == 3 and at_least.choices[0].finish_reason == "stop"
    ignored = client.chat.completions.create(**kwargs, logit_bias=eot, extra_body={"ignore_eos": True})
    assert ignored.usage.completion_tokens == 10 and ignored.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs,param", [
    (dict(extra_body={"guided_regex": "([a-"}), None),  # the server's compiler refuses it
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}), None),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex"),
    (dict(response_format={"type": "json_object"}, extra_body={"ignore_eos": True}), "response_format"),
    (dict(logit_bias={"99999": 5}), None),
    (dict(extra_body={"guided_decoding_backend": "outlines"}), "guided_decoding_backend"),
    (dict(extra_body={"bad_words": ["x"]}), "bad_words"),
])
def test_refused_values_are_400s(client, kwargs: dict, param: str | None) -> None:  # type: ignore[no-untyped-def]
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="mol2", messages=USER, max_tokens=5, **kwargs)
    if param:
        assert info.value.body.get("param") == param, info.value.body
