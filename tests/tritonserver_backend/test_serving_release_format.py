"""A checkpoint in the release's storage (fp8 32x32 blocks, packed fp4 experts, fp8 Engram tables with per-row scales)
with Engram at layers 1 and 2 and the release's fp8 runtime fake-quant, built into ONNX engines and served by a real
tritonserver: the encoder model gathers Engram rows from the memory-mapped shards for every prefill and decode step,
and the served conversation is token for token the in-process pipeline's.

Random weights, random adapters (`release_writer.write_random_adapters`) and no trained router: this checks that every
part runs on the release's formats, not what the model says. One build (about a minute) for the module.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from build_engines.build.cli import main as build
from build_engines.formats.release_writer import TOKENIZER_FILES, write_random_adapters
from ced.formats.checkpoint import CheckpointFiles, role_tensor_names, write_synthetic_release
from ced.model.engram import compressed_token_map_from_file
from tests.ced.model.test_engram import engram_config
from tests.conftest import EMBEDDED

pytestmark = pytest.mark.slow
# fixed: the build's parity check runs on this checkpoint (the fake-quant graphs are checked bit-level elsewhere)
SEED = 7


@pytest.fixture(scope="module")
def served(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tritonserver_backend.launcher import TritonServer
    from tritonserver_backend.repository import main as render

    root = tmp_path_factory.mktemp("release_format")
    model = root / "model"
    model.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy2(EMBEDDED / name, model / name)
    token_map = compressed_token_map_from_file(model / "tokenizer.json")
    cfg = engram_config(vocab_size=len(token_map), runtime_fake_quant=True,
                        engram_compressed_vocab_size=int(token_map.max()) + 1)
    write_synthetic_release(cfg, model, seed=SEED, shards=3, extras=False)
    write_random_adapters(model, seed=SEED)
    engines = root / "engines"
    assert build(["--model", str(model), "--out", str(engines)]) == 0
    repo = root / "repo"
    render(["--out", str(repo), "--model-dir", str(model), "--registry-root", str(root / "registry"),
            "--engine-dir", str(engines), "--max-context", "2048"])
    server = TritonServer(work_dir=root / "server")
    server.start(repo)
    try:
        server.wait_ready(300)
        yield SimpleNamespace(server=server, model=model, cfg=cfg, engines=engines)
    finally:
        server.stop()


def test_the_checkpoint_is_stored_as_released(served) -> None:  # type: ignore[no-untyped-def]
    files = CheckpointFiles(served.model)
    assert files.tensors["layers.2.engram.embed.weight"].dtype == "F8_E4M3"
    assert files.tensors["layers.2.engram.embed.scale"].dtype == "F8_E8M0"
    assert files.tensors["layers.1.attn.wq_a.weight"].dtype == "F8_E4M3"
    assert files.tensors["layers.5.ffn.experts.0.w1.weight"].dtype == "I8"


CONVERSATION = [("Hi! How was your day?", None), ("ls -la shows nothing", None),
                ("Make the header sticky.", "L3_design")]


def test_a_conversation_is_served_as_the_in_process_pipeline_serves_it(served, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Three greedy turns (routed, routed, explicit adapter) through tritonserver on two sessions, and through the
    in-process pipeline on the same engines: the same tokens everywhere, so the served encoder model (its Engram rows
    gathered per prefill chunk and per decode step, its n-gram history kept across turns) computes what the library
    computes, and two sessions never share state."""
    from tritonserver_backend.adapters.registry_init import ensure_registry
    from tritonserver_backend.clients.client import GrpcChat, TurnRequest
    from tritonserver_backend.core.pipeline import InProcessPipeline
    from tritonserver_backend.sampling.sampler import SamplingParams

    chat = GrpcChat(served.server.grpc_url)
    try:
        served_turns: dict[str, list[tuple[str, list[int]]]] = {}
        for session in ("one", "two"):
            served_turns[session] = []
            for i, (text, adapter) in enumerate(CONVERSATION):
                reply = chat.turn(TurnRequest(session, text, new_session=i == 0, adapter=adapter, max_tokens=6))
                assert reply.error is None and reply.token_ids, reply.error
                served_turns[session].append((reply.adapter, reply.token_ids))
    finally:
        chat.close()
    assert served_turns["one"] == served_turns["two"]
    assert served_turns["one"][2][0] == "L3_design"
    ensure_registry(tmp_path / "registry", served.model)
    pipe = InProcessPipeline(served.model, tmp_path / "registry", backend="onnx", engine_dir=served.engines)
    local = [(r.adapter, r.token_ids) for r in (pipe.chat("local", text, adapter=adapter, new_session=i == 0,
                                                          params=SamplingParams(max_tokens=6))
                                                for i, (text, adapter) in enumerate(CONVERSATION))]
    assert local == served_turns["one"]


def test_the_engines_keep_the_weights_as_stored(served) -> None:  # type: ignore[no-untyped-def]
    """The build took the bounded path: each role's graph holds the checkpoint's bytes (fp8 codes, packed fp4, e8m0
    scales as uint8; bf16 as bf16) in its data file, the module it was checked against held exactly the role's
    stored bytes, and no weight was folded into an fp32 copy."""
    import json

    import onnx

    manifest = json.loads((served.engines / "manifest.json").read_text())
    for role in ("encoder", "decoder"):
        graph = manifest["graphs"][role]
        weights = graph["weights"]
        assert weights["held_bytes"] == weights["role_checkpoint_bytes"]
        assert 0.95 * weights["role_checkpoint_bytes"] <= graph["data_bytes"] <= 1.01 * weights["role_checkpoint_bytes"]
        assert min(weights[f"{phase}_peak_rss_bytes"] for phase in ("export", "graph_run", "check")) > 0
        model = onnx.load(str(served.engines / graph["file"]), load_external_data=False)
        large = {onnx.TensorProto.DataType.Name(t.data_type) for t in model.graph.initializer if len(t.external_data)}
        assert large <= {"UINT8", "BFLOAT16", "FLOAT", "INT64", "BOOL"}, large  # int64: index tables of the graph
        fp32_bytes = sum(int(next(e.value for e in t.external_data if e.key == "length"))
                         for t in model.graph.initializer
                         if len(t.external_data) and t.data_type == onnx.TensorProto.FLOAT)
        files = CheckpointFiles(served.model)
        stored_f32 = sum(files.tensors[n].nbytes for n in role_tensor_names(served.cfg, role)
                         if files.tensors[n].dtype == "F32")
        # the f32 the release stores (mHC, sinks, gate biases) + lookup tables
        assert fp32_bytes <= stored_f32 + 64 * 1024


def test_sessions_that_share_a_prefix_hit_the_cache_and_answer_as_cold(served, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On the release format with Engram (its n-gram history is part of what a cached prefix holds): sessions that
    open with one document under two adapters take it from the encoder's prefix cache and answer with the tokens the
    in-process pipeline gives without a cache."""
    from tests.tritonserver_backend.test_prefix_cache import metric
    from tritonserver_backend.adapters.registry_init import ensure_registry
    from tritonserver_backend.clients.client import GrpcChat, TurnRequest
    from tritonserver_backend.core.pipeline import InProcessPipeline
    from tritonserver_backend.sampling.sampler import SamplingParams

    document = " ".join(f"shelf {i} holds {i * 13 % 17} boxes of screws;" for i in range(60))
    texts = {adapter: f"{document}\nWhich shelf is fullest? ({adapter})" for adapter in ("L0_chat", "L2_code")}
    hits = metric(served.server, "mol2_prefix_cache_hits", "shared")
    chat = GrpcChat(served.server.grpc_url)
    try:
        chat.turn(TurnRequest("prefix-warm", document + "\nHow many shelves?", new_session=True, max_tokens=2,
                              end_session=True))
        replies = {a: chat.turn(TurnRequest(f"prefix-{a}", t, new_session=True, adapter=a, max_tokens=6,
                                            end_session=True)) for a, t in texts.items()}
    finally:
        chat.close()
    assert metric(served.server, "mol2_prefix_cache_hits", "shared") == hits + len(texts)
    ensure_registry(tmp_path / "registry", served.model)
    pipe = InProcessPipeline(served.model, tmp_path / "registry", backend="onnx", engine_dir=served.engines)
    for adapter, text in texts.items():
        assert not replies[adapter].error, replies[adapter].error
        alone = pipe.chat(f"cold-{adapter}", text, adapter=adapter, new_session=True,
                          params=SamplingParams(max_tokens=6))
        assert replies[adapter].token_ids == alone.token_ids, adapter
