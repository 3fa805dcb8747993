"""The quantized engines (ModelOpt fp8, and fp8 with fp8 KV state) served by a real tritonserver: a routed multi-turn
conversation over gRPC streaming gives, token for token, what the in-process pipeline gives on the same engine
directory.

Why a separate module: the fixtures of `test_serving_triton.py` serve the fp32 engines (onnx and torch backends);
here one server per quantization mode is started on `engine_dir` = the quantized directory, and only the
conversation and the batched-sessions check run on it (the transport and error paths do not depend on the engine).
The fp8-KV server runs with speculative decoding (the DSpark drafter, which quantized builds copy unquantized, drafting
from the quantized decoder's `draft_main` rows): its replies must still be the in-process plain pipeline's, token
for token, and its metrics must show drafts verified. The int8 build is checked in process
(`tests/build_engines/quantize/`) but not served: it loads and runs through the same onnxruntime path as fp8 (standard
Q/DQ), and a third server costs CI about 25 s.
"""

from __future__ import annotations

import pytest
import tritonclient.grpc  # noqa: F401 - GrpcChat's transport (the serve extra): a broken install fails, not skips

from tests.conftest import DEFAULT_ENGINES, EMBEDDED
from tests.tritonserver_backend.streams import concurrent_token_ids, reference_reply
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.clients.client import GrpcChat, TurnRequest
from tritonserver_backend.core.pipeline import InProcessPipeline

pytestmark = pytest.mark.slow
TOKENS = 8
CONVERSATION = [  # routed turns, explicit adapters, and a routed turn after an explicit one
    ("Hi! How was your day?", None, True),
    ("def mean(xs):\n    return sum(xs) / len(xs)", None, False),
    ("Make the header sticky with a shadow.", "L3_design", False),
    ("git log --oneline shows nothing, why?", None, False),
    ("Thanks, that helps.", "base", False),
    ("Now sort that list in reverse.", "L2_code", False),
]


BUILDS = {"fp8": ["--quant", "fp8"], "fp8-kv8": ["--quant", "fp8", "--kv-quant", "fp8"]}


@pytest.fixture(scope="module", params=list(BUILDS))
def quantized_dir(request, default_engines):  # type: ignore[no-untyped-def]
    """(weight mode, the quantized engine directory), built from the fp32 graphs or reused when current: the same
    directories `tests/build_engines/quantize/` use. "fp8-kv8" also keeps its rings and global-KV stores in fp8, so
    the server's sessions hold fp8 state (uint8 codes) between turns and batched steps."""
    from build_engines.build.cli import main as build

    out = DEFAULT_ENGINES.parent / f"mol2-small-{request.param}"
    code = build(["--model", str(EMBEDDED), "--out", str(out), *BUILDS[request.param], "--reuse-fp32",
                  str(default_engines)])
    assert code == 0, f"python -m build_engines build {BUILDS[request.param]} exited {code}"
    return request.param.split("-")[0], out


@pytest.fixture(scope="module")
def server(tmp_path_factory, quantized_dir):  # type: ignore[no-untyped-def]
    from tritonserver_backend.launcher import TritonNotFoundError, TritonServer
    from tritonserver_backend.repository import build_repository

    mode, engine_dir = quantized_dir
    work = tmp_path_factory.mktemp(f"triton-{engine_dir.name}")
    params = {"model_dir": str(EMBEDDED), "registry_root": str(work / "registry"), "max_context": "2048",
              "engine_backend": "onnx", "engine_dir": str(engine_dir),
              # the fp8-KV server decodes speculatively: every check below then also holds with drafting on
              "speculative": "dspark" if engine_dir.name.endswith("kv8") else "off"}
    repo = build_repository(work / "repo", params)
    try:
        srv = TritonServer(work_dir=work / "server")
    except TritonNotFoundError as exc:
        pytest.fail(f"tritonserver not found although the serve extra is installed: {exc}")
    srv.start(repo)
    try:
        srv.wait_ready(240)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, quantized_dir):  # type: ignore[no-untyped-def]
    _, engine_dir = quantized_dir
    root = tmp_path_factory.mktemp("reference_registry")
    ensure_registry(root, EMBEDDED)
    return InProcessPipeline(EMBEDDED, root, max_context=2048, backend="onnx", engine_dir=engine_dir)


_reference = reference_reply


def test_the_server_serves_the_quantized_directory(server, quantized_dir) -> None:  # type: ignore[no-untyped-def]
    """Every engine-holding model is READY on the quantized directory (opening it checks its manifest: quantized,
    current for this checkpoint), and its config names that directory."""
    import tritonclient.http as httpclient

    mode, engine_dir = quantized_dir
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        for model in ("encoder", "decoder", "router"):
            assert client.is_model_ready(model), model
            params = client.get_model_config(model)["parameters"]
            assert (params["engine_dir"]["string_value"] == str(engine_dir)
                    and params["engine_backend"]["string_value"] == "onnx")
    finally:
        client.close()
    import json

    assert json.loads((engine_dir / "manifest.json").read_text())["settings"]["quant"] == mode


def test_routed_conversation_matches_the_in_process_pipeline_token_for_token(server, reference) -> None:  # type: ignore[no-untyped-def]
    chat = GrpcChat(server.grpc_url)
    adapters = []
    try:
        for text, adapter, new in CONVERSATION:
            req = TurnRequest("quant-conv", text, new_session=new, adapter=adapter, max_tokens=TOKENS)
            got, want = chat.turn(req), _reference(reference, req)
            assert got.error is None, got.error
            assert got.token_ids == want.token_ids and len(got.token_ids) > 0, (text, got, want)
            assert got.adapter == want.adapter and got.finish_reason == want.finish_reason
            adapters.append(got.adapter)
    finally:
        chat.close()
    assert adapters[2] == "L3_design" and adapters[4] == "base" and adapters[5] == "L2_code", "explicit adapters win"
    assert len(set(adapters)) >= 3, f"the conversation visits several adapters: {adapters}"


def test_concurrent_sessions_in_batched_steps_match_their_solo_runs(server, reference) -> None:  # type: ignore[no-untyped-def]
    """Six sessions at once (mixed adapters, routed turns): batched decode rows of the quantized decoder give every
    session exactly its solo tokens."""
    adapters = ["L0_chat", None, "L2_code", "base", None, "L3_design"]
    requests = [[TurnRequest(f"qpar{i}", f"Question {i}: how do I sort a list in Python?", new_session=True, adapter=a,
                             max_tokens=TOKENS + i % 3),
                 TurnRequest(f"qpar{i}", "And after that?", max_tokens=TOKENS)] for i, a in enumerate(adapters)]
    solo = [[_reference(reference, r).token_ids for r in turns] for turns in requests]
    results, errors = concurrent_token_ids(server.grpc_url, requests)
    assert not errors, errors
    assert results == solo


def test_speculative_steps_on_fp8_kv_state_give_the_plain_replies(server, reference, quantized_dir) -> None:  # type: ignore[no-untyped-def]
    """Longer turns on the fp8-KV server (drafting on): token for token the in-process plain pipeline's replies, with
    speculative blocks verified (a rejected draft's fp8 state is never written: docs/speculative.md)."""
    import urllib.request

    if not quantized_dir[1].name.endswith("kv8"):
        pytest.skip("only the fp8-KV server decodes speculatively (the fp8 server's replies are checked plain above)")
    chat = GrpcChat(server.grpc_url)
    try:
        for i, (text, adapter, new) in enumerate(CONVERSATION[:4]):
            req = TurnRequest("quant-spec", text, new_session=new, adapter=adapter, max_tokens=24)
            got, want = chat.turn(req), _reference(reference, req)
            assert got.error is None and got.token_ids == want.token_ids, (i, got, want)
    finally:
        chat.close()
    lines = urllib.request.urlopen(server.metrics_url).read().decode().splitlines()
    blocks = sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("mol2_speculative_blocks{"))
    assert blocks > 0, "no speculative block was verified"
