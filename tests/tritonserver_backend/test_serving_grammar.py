"""Issue 32 on a real tritonserver: the `grammar` input (structured outputs) and the sampling inputs top_k, min_p,
logit_bias, stop_token_ids, min_tokens and ignore_eos, over gRPC and HTTP, against the in-process pipeline token for
token; grammar rows batched with others; bad values refused before anything is encoded."""

from __future__ import annotations

import json
import uuid

import jsonschema
import pytest

from tests.conftest import EMBEDDED
from tests.tritonserver_backend.streams import concurrent_token_ids
from tests.tritonserver_backend.test_sampling_grammar import SCHEMAS
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.client import GrpcChat, HttpChat, TurnRequest
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.sampling.grammar import canonical
from tritonserver_backend.sampling.sampler import SamplingParams

pytestmark = pytest.mark.slow
EOT = 6


@pytest.fixture(scope="module")
def server(shared_server):  # type: ignore[no-untyped-def]
    return shared_server(max_context="2048")  # conftest.py: shared with the exactness and speculative modules


@pytest.fixture(scope="module")
def reference(tmp_path_factory, default_engines):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("grammar-reference")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, max_context=2048, backend="onnx", engine_dir=default_engines)


def _params(r: TurnRequest) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens or 64, temperature=r.temperature or 0.0, seed=r.seed or 0,
                          top_k=r.top_k or 0, min_p=r.min_p or 0.0,
                          logit_bias=tuple(sorted((int(k), float(v)) for k, v in (r.logit_bias or {}).items())),
                          stop_token_ids=tuple(r.stop_token_ids or ()), min_tokens=r.min_tokens or 0,
                          ignore_eos=r.ignore_eos, grammar=canonical(json.dumps(r.grammar)) if r.grammar else "")


def _reference(pipe: InProcessPipeline, r: TurnRequest):  # type: ignore[no-untyped-def]
    return pipe.chat(r.session_id, r.text, r.adapter, r.new_session, None, _params(r))


def _sid() -> str:
    return f"g-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("transport,stream", [("grpc", True), ("http", True), ("http", False)])
def test_schemas_give_valid_json_matching_the_reference(server, reference, transport: str, stream: bool) -> None:  # type: ignore[no-untyped-def]
    chat = GrpcChat(server.grpc_url) if transport == "grpc" else HttpChat(server.http_url)
    try:
        for (name, schema), adapter in zip(SCHEMAS.items(), [None, "L2_code", "base"]):
            request = TurnRequest(_sid(), "Who are you? Answer in JSON.", new_session=True, adapter=adapter,
                                  max_tokens=200, stream=stream, grammar={"type": "json_schema", "schema": schema})
            reply = chat.turn(request)
            assert reply.error is None, reply.error
            assert reply.finish_reason == "end_of_turn", (name, reply.text)
            jsonschema.validate(json.loads(reply.text), schema)
            want = _reference(reference, request)
            assert (reply.token_ids, reply.adapter) == (want.token_ids, want.adapter), name
    finally:
        if transport == "grpc":
            chat.close()


def test_grammar_rows_batch_with_plain_rows_and_keep_their_solo_replies(server, reference) -> None:  # type: ignore[no-untyped-def]
    grammars = [{"type": "json_schema", "schema": s} for s in SCHEMAS.values()] + [
        {"type": "regex", "pattern": "[a-z]{4}-[0-9]{2}"},
        {"type": "ebnf", "grammar": 'root ::= "yes" | "no"'}, None, None]
    requests = [TurnRequest(_sid(), f"Question {i}: what now?", new_session=True, max_tokens=60, grammar=g,
                            temperature=0.8 if i % 2 else None, seed=i) for i, g in enumerate(grammars)]
    got, errors = concurrent_token_ids(server.grpc_url, [[r] for r in requests])
    assert not errors, errors
    for r, ids in zip(requests, got):
        assert ids[0] == _reference(reference, r).token_ids, r.grammar


def test_sampling_inputs_over_the_tensor_api(server, reference) -> None:  # type: ignore[no-untyped-def]
    chat = GrpcChat(server.grpc_url)
    http = HttpChat(server.http_url)
    try:
        text = "How do I center a div?"
        greedy = chat.turn(TurnRequest(_sid(), text, new_session=True, adapter="L3_design", max_tokens=10))
        top1 = http.turn(TurnRequest(_sid(), text, new_session=True, adapter="L3_design", max_tokens=10,
                                     temperature=1.2, seed=9, top_k=1))
        assert top1.token_ids == greedy.token_ids
        sampled = TurnRequest(_sid(), text, new_session=True, max_tokens=10, temperature=1.0, seed=4, top_k=20,
                              min_p=0.05)
        assert chat.turn(sampled).token_ids == _reference(reference, sampled).token_ids
        brace = reference.text.tokenizer.encode("{")[0]
        forced = http.turn(TurnRequest(_sid(), text, new_session=True, max_tokens=4, logit_bias={str(brace): 100}))
        assert forced.token_ids == [brace] * 4 and forced.finish_reason == "length"
        k = next(i for i, t in enumerate(greedy.token_ids) if i and t not in greedy.token_ids[:i])
        stopped = chat.turn(TurnRequest(_sid(), text, new_session=True, adapter="L3_design", max_tokens=10,
                                        stop_token_ids=[greedy.token_ids[k], 7]))
        assert stopped.token_ids == greedy.token_ids[:k] and stopped.finish_reason == "stop"
        eot = {str(EOT): 100}
        assert chat.turn(TurnRequest(_sid(), text, new_session=True, max_tokens=6, logit_bias=eot)).token_ids == []
        at_least = http.turn(TurnRequest(_sid(), text, new_session=True, max_tokens=6, logit_bias=eot, min_tokens=2))
        assert len(at_least.token_ids) == 2 and at_least.finish_reason == "end_of_turn"
        ignored = chat.turn(TurnRequest(_sid(), text, new_session=True, max_tokens=6, logit_bias=eot, ignore_eos=True))
        assert len(ignored.token_ids) == 6 and ignored.finish_reason == "length"
    finally:
        chat.close()


@pytest.mark.parametrize("fields,needle", [
    (dict(grammar={"type": "regex", "pattern": "([a-"}), "does not compile"),
    (dict(grammar={"type": "json_schema", "schema": {"type": "nonsense"}}), "does not compile"),
    (dict(grammar={"type": "xml"}), "grammar must be"),
    (dict(grammar={"type": "json_object"}, ignore_eos=True), "cannot be combined"),
    (dict(logit_bias={"99999": 1}), "outside the vocabulary"),
    (dict(logit_bias={"5": 500}), "logit_bias"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(min_tokens=50, max_tokens=10), "min_tokens"),
])
def test_bad_values_are_refused_before_the_turn_is_encoded(server, fields: dict, needle: str) -> None:  # type: ignore[no-untyped-def]
    chat = GrpcChat(server.grpc_url)
    try:
        sid = _sid()
        first = chat.turn(TurnRequest(sid, "Hello", new_session=True, max_tokens=3))
        assert first.error is None, first.error
        bad = chat.turn(TurnRequest(sid, "Then?", **{"max_tokens": 3, **fields}))
        assert bad.error is not None and needle in bad.error, bad.error
        again = chat.turn(TurnRequest(sid, "Then?", max_tokens=3))  # nothing was encoded: the session continues
        assert again.error is None, again.error
    finally:
        chat.close()
