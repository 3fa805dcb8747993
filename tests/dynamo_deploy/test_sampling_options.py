"""Dynamo's preprocessed sampling options reach our sampler: top_k / min_p / logit_bias / min_tokens / ignore_eos /
stop_token_ids and structured outputs (`guided_decoding`, from response_format), across the encoder -> decoder wire;
what the workers cannot serve (n > 1, a structural tag, two constraints) is refused with a 400, never dropped."""

from __future__ import annotations

import json
import socket

import jsonschema
import pytest

from dynamo_deploy.client import Conversation
from dynamo_deploy.launcher import DYNAMO_PYTHON, Deployment
from dynamo_deploy.requests import params_from_json, params_to_json, sampling_params
from tests.conftest import EMBEDDED
from tritonserver_backend.errors import BadRequest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


def test_every_option_maps_and_crosses_the_wire_unchanged() -> None:
    request = {"sampling_options": {"temperature": 0.7, "top_k": 5, "min_p": 0.1, "seed": 3,
                                    "logit_bias": {"42": -100.0}, "guided_decoding": {"json": SCHEMA}},
               "stop_conditions": {"max_tokens": 9, "stop_token_ids": [7], "stop_token_ids_hidden": [6],
                                   "stop": ["zz"]}}
    p = sampling_params(request)
    assert ((p.top_k, p.min_p, p.logit_bias, p.stop_token_ids, p.seed, p.max_tokens)
            == (5, 0.1, ((42, -100.0),), (7,), 3, 9))
    assert json.loads(p.grammar) == {"type": "json_schema", "schema": SCHEMA}
    assert params_from_json(json.loads(json.dumps(params_to_json(p)))) == p, (
        "the decoder worker samples as the encoder read")
    plain = sampling_params({"stop_conditions": {"min_tokens": 2, "ignore_eos": True}})
    assert (plain.min_tokens, plain.ignore_eos, plain.grammar) == (2, True, "")
    choice = sampling_params({"sampling_options": {"guided_decoding": {"choice": ["yes", "no."]}}})
    assert json.loads(choice.grammar) == {"type": "regex", "pattern": "(yes|no\\.)"}
    assert (json.loads(sampling_params({"sampling_options": {"guided_decoding": {"json": {}}}}).grammar)
            == {"type": "json_object"})


@pytest.mark.parametrize("options,message", [
    ({"n": 2}, "n > 1 is not served"),
    ({"guided_decoding": {"json": SCHEMA, "regex": "a+"}}, "one structured-output constraint at a time"),
    ({"guided_decoding": {"structural_tag": "{}"}}, "structural_tag"),
    ({"guided_decoding": {"grammar": ""}}, "needs \"grammar\""),
])
def test_what_cannot_be_served_is_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        sampling_params({"sampling_options": options})


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    if not DYNAMO_PYTHON.exists():
        pytest.fail(f"{DYNAMO_PYTHON} missing: run `bash scripts/setup_dynamo.sh` (scripts/setup.sh does)")
    d = Deployment(tmp_path_factory.mktemp("dynamo-sampling"), EMBEDDED, default_engines, encoders=1, decoders=1,
                   http_port=_port())
    try:
        d.start(timeout_s=300)
        yield d
    finally:
        d.stop()


@pytest.mark.slow
def test_response_format_gives_schema_valid_json_and_refusals_are_400s(deployment) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(deployment.url, "structured")
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    reply = conv.say("Plan a short trip as JSON.", max_tokens=64, response_format=fmt)
    jsonschema.validate(json.loads(reply["text"]), SCHEMA)
    greedy = Conversation(deployment.url, "greedy").say("Name a colour.", max_tokens=8)
    top1 = Conversation(deployment.url, "top1").say("Name a colour.", max_tokens=8, top_k=1)
    assert top1["text"] == greedy["text"], "top_k=1 is greedy"
    with pytest.raises(RuntimeError, match="HTTP 400.*n > 1 is not served"):
        Conversation(deployment.url, "many").say("Hello.", max_tokens=4, n=2, temperature=0.7)
