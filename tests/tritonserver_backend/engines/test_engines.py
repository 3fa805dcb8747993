"""The engine interface: selector errors, and the served default's onnx engine against the torch reference."""

from __future__ import annotations

import numpy as np
import pytest

from ced.steps.lora_grid import lora_grid
from ced.steps.parity import HANDOVER
from ced.steps.rows import (
    DecoderRow,
    EncoderRow,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)
from tests.conftest import EMBEDDED
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.core.pipeline import InProcessPipeline
from tritonserver_backend.engines import EngineUnavailable, open_engine
from tritonserver_backend.sampling.sampler import SamplingParams


def test_the_selector_says_what_is_missing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EngineUnavailable, match="unknown engine backend 'tensorflow'"):
        open_engine("tensorflow", EMBEDDED, tmp_path)
    with pytest.raises(EngineUnavailable,
                       match=r"no manifest.*python -m build_engines build --model .* --out .* --format onnx"):
        open_engine("onnx", EMBEDDED, tmp_path / "nothing_here")
    with pytest.raises(EngineUnavailable, match="TensorRT|NVIDIA GPU"):
        open_engine("trt", EMBEDDED, tmp_path)


@pytest.mark.slow
def test_onnx_engine_follows_the_torch_reference_on_the_default(default_engines) -> None:  # type: ignore[no-untyped-def]
    """Prefill, replay under each bundled adapter, decode: logits within 1e-3 (reported), the same greedy tokens."""
    engines = {b: open_engine(b, EMBEDDED, default_engines) for b in ("torch", "onnx")}
    import torch

    from ced.lora import AdapterBank
    from ced.model.network import CEDNetwork
    from ced.steps.lora_stacked import stack_adapters

    layout = engines["torch"].layout
    with torch.device("meta"):
        shapes = CEDNetwork(layout.cfg)
    adapters = AdapterBank(layout.cfg, shapes).load_bundled(EMBEDDED)
    bank = stack_adapters(layout, [None, *[adapters[k] for k in sorted(adapters)]])
    worst = 0.0
    for engine in engines.values():
        engine.set_lora_bank(bank)
    rows = {b: (EncoderRow.empty(layout), DecoderRow.empty(layout)) for b in engines}
    prompt = np.random.default_rng(0).integers(0, layout.cfg.vocab_size, (1, 180))
    for slot in range(len(adapters) + 1):
        tokens = {}
        for b, engine in engines.items():
            erow, drow = rows[b]
            if slot == 0:
                out = engine.encoder(encoder_inputs(layout, [erow], prompt))
                absorb_encoder(layout, [erow], out, prompt.shape[1])
                drow.absorb(layout, {k: out[k][0] for k in HANDOVER})
            feed = decoder_inputs(layout, [drow], None, [slot])
            logits = engine.decoder(feed)["logits"]
            tokens[b] = logits
        worst = max(worst, float(np.abs(tokens["torch"] - tokens["onnx"]).max()))
        assert tokens["torch"].argmax() == tokens["onnx"].argmax()
    token = int(tokens["torch"].argmax())
    for _ in range(12):
        logits = {}
        for b, engine in engines.items():
            erow, drow = rows[b]
            out = engine.encoder(encoder_inputs(layout, [erow], np.array([[token]])))
            absorb_encoder(layout, [erow], out, 1)
            new = {k: out[k][0] for k in HANDOVER}
            drow.absorb(layout, new)
            feed = decoder_inputs(layout, [drow], [{k: new[k] for k in HANDOVER[:4]}], [len(adapters)])
            result = engine.decoder(feed)
            absorb_decoder([drow], result, feed, False, [len(adapters)])
            logits[b] = result["logits"]
        worst = max(worst, float(np.abs(logits["torch"] - logits["onnx"]).max()))
        assert logits["torch"].argmax() == logits["onnx"].argmax()
        token = int(logits["torch"].argmax())
    print(f"trained default, onnx vs torch: max abs logit difference {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.slow
def test_a_routed_five_turn_conversation_is_the_same_on_both_engines(default_engines, tmp_path) -> None:  # type: ignore[no-untyped-def]
    conversation = [("Hi! How was your day?", None, True), ("def mean(xs):\n    return sum(xs) / len(xs)", None, False),
                    ("Make the header sticky with a shadow.", "L3_design", False),
                    ("git log --oneline shows nothing, why?", None, False), ("Thanks, that helps.", "base", False)]
    results = {}
    for backend in ("torch", "onnx"):
        root = tmp_path / backend
        ensure_registry(root, EMBEDDED)
        pipe = InProcessPipeline(EMBEDDED, root, backend=backend, engine_dir=default_engines)
        results[backend] = [(r.adapter, r.token_ids) for r in (pipe.chat("s", text, adapter=a, new_session=new,
                                                                         params=SamplingParams(max_tokens=24))
                                                              for text, a, new in conversation)]
    assert results["torch"] == results["onnx"]
    assert [a for a, _ in results["onnx"]][2] == "L3_design" and results["onnx"][4][0] == "base"
    assert all(len(t) > 0 for _, t in results["onnx"])


def test_onnx_threads_beyond_one_sleep_instead_of_spinning(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Several engine stubs share the cores: spinning pool threads took them from each other (docs/load.md)."""
    from tritonserver_backend.engines.onnx_engine import session_options

    spin = "session.intra_op.allow_spinning"
    monkeypatch.delenv("MOL2_ORT_SPIN", raising=False)
    assert session_options(2).get_session_config_entry(spin) == "0"
    assert session_options(1).intra_op_num_threads == 1
    with pytest.raises(RuntimeError, match="does not have"):  # one thread: no pool, the entry stays unset
        session_options(1).get_session_config_entry(spin)
    monkeypatch.setenv("MOL2_ORT_SPIN", "1")
    with pytest.raises(RuntimeError, match="does not have"):
        session_options(2).get_session_config_entry(spin)


@pytest.fixture(scope="module")
def release_shaped(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The release-shaped checkpoint of docs/speculative.md's DSpark defect (40 layers, Engram, fp8/fp4 storage and
    the runtime fake-quant, the release's `mtp.*`), with random adapters and their registry."""
    from build_engines.formats.release_writer import ReleaseShape, write_random_adapters, write_release_shaped

    root = tmp_path_factory.mktemp("release_shaped")
    model = write_release_shaped(root / "release", ReleaseShape(dim=64, experts=8, inter=64, dspark_experts=4,
                                                                engram_vocab=200, shards=2), force=True)
    write_random_adapters(model, seed=3)
    ensure_registry(root / "registry", model)
    return model, root / "registry"


@pytest.mark.slow
def test_the_torch_engine_verifies_a_block_as_one_position_steps_decode_it(release_shaped) -> None:  # type: ignore[no-untyped-def]
    """A speculative step's `verify_logits` are, position by position and bit for bit, the logits of one-position
    steps, and its hand-over rows those steps' rows: what lets greedy drafting give the plain tokens. PyTorch's CPU
    kernels are picked by shape (MKL's GEMM by row count, ATen's sigmoid/SiLU loops by element count); unpadded, and
    on AVX-512 padded to 4 positions, the last bits differed and the release's fake-quant grew them into other greedy
    tokens. Blocks of 4, 6 and 8 (the longest decode step) positions, the last across a store's doubling."""
    from build_engines.build.onnx_build import random_bank
    from ced.steps.rows import HANDOVER_FIELDS
    from ced.steps.step_loop import prefill_and_replay

    engine = open_engine("torch", release_shaped[0], None)
    layout = engine.layout
    engine.set_lora_bank(random_bank(layout, slots=2, rank=2))
    rng = np.random.default_rng(13)

    def step(erow, drow, tokens, verify):  # type: ignore[no-untyped-def]
        out = engine.encoder(encoder_inputs(layout, [erow], tokens, engram=engine.engram))
        absorb_encoder(layout, [erow], out, tokens.shape[1], tokens)
        handover = {k: out[k][0] for k in HANDOVER}
        drow.absorb(layout, handover)
        feed = decoder_inputs(layout, [drow], [{f: handover[f] for f in HANDOVER_FIELDS}], [1], verify=verify)
        result = engine.decoder(feed)
        absorb_decoder([drow], result, feed, False, [1])
        return out, result

    # short and longer contexts, both ratio-2 parities; at 28 the block's stores double (to 64 entries), the steps' not
    for history, block_size in ((13, 4), (36, 4), (37, 6), (28, 8)):
        session = prefill_and_replay(layout, engine.encoder, engine.decoder, {},
                                     rng.integers(0, layout.cfg.vocab_size, history), chunk=16, slot=1,
                                     engram=engine.engram)
        block = rng.integers(0, layout.cfg.vocab_size, (1, block_size))
        out, verified = step(session[0].clone(), session[1].clone(), block, np.arange(block_size)[None])
        assert verified["logits"].tobytes() == verified["verify_logits"][:, -1].tobytes()
        erow, drow = session
        for i in range(block_size):
            single_out, single = step(erow, drow, block[:, i:i + 1], np.zeros((1, 0), np.int64))
            assert single["verify_logits"].shape == (1, 0, layout.cfg.vocab_size)
            assert single["logits"][0].tobytes() == verified["verify_logits"][0, i].tobytes(), (history, i)
            for name in HANDOVER:
                assert single_out[name][0, 0].tobytes() == out[name][0, i].tobytes(), (history, i, name)


@pytest.mark.slow
def test_dspark_blocks_leave_greedy_replies_on_a_release_shaped_checkpoint_unchanged(release_shaped) -> None:  # type: ignore[no-untyped-def]
    """docs/speculative.md's defect, through the in-process serving path on the torch engine: two greedy turns with
    DSpark drafting blocks of 3 (4 verified positions) equal the plain replies token for token."""
    from tritonserver_backend.core.drafting import make_drafter

    pipeline = InProcessPipeline(*release_shaped, max_context=2048)
    replies: dict[int, list[list[int]]] = {}
    for block in (0, 3):
        pipeline.drafter = make_drafter("dspark", block, pipeline.engine) if block else None
        replies[block] = [pipeline.chat(f"s{block}", text, adapter="base", new_session=i == 0,
                                        params=SamplingParams(max_tokens=12)).token_ids
                          for i, text in enumerate(("Hello there, how are you?", "Tell me more about that."))]
    assert replies[3] == replies[0]


def test_steps_are_padded_to_whole_tiles_only_where_last_bits_flip_tokens(release_shaped) -> None:  # type: ignore[no-untyped-def]
    """The padding costs a share of a CPU decode step, so it is on for checkpoints with the release's runtime
    fake-quant (where the last bits moved greedy tokens) and off for the embedded default."""
    from ced.formats.config_file import load_config
    from tritonserver_backend.engines.torch_engine import whole_blocks

    assert whole_blocks(load_config(release_shaped[0]))
    assert not whole_blocks(load_config(EMBEDDED))


def test_every_decode_step_runs_the_step_modules_at_one_shape_when_padded() -> None:
    """What makes a verify block's bits a one-position step's on any CPU: padded, every decode step (the fed token
    and up to MAX_BLOCK drafts) reaches the step modules at exactly STEP_TILE positions, with a LoRA grid over them
    and a head of exactly HEAD_TILE rows, whatever its length and however many positions it verifies; the outputs
    come back cut to the real positions, `logits` the last real one's and `verify_logits` the asked ones'."""
    from tritonserver_backend.core.drafting import MAX_BLOCK
    from tritonserver_backend.engines.torch_engine import HEAD_TILE, STEP_TILE, run_decoder_rows, run_encoder_rows

    assert STEP_TILE >= MAX_BLOCK + 1 and HEAD_TILE >= STEP_TILE + 2  # the padded last position + asked + last real
    seen: set[tuple[tuple[int, ...], ...]] = set()

    def encoder(feed):  # type: ignore[no-untyped-def]
        seen.add((("encoder",), feed["tokens"].shape))
        S = feed["tokens"].shape[1]
        return {"streams": np.arange(S, dtype=np.float32).reshape(1, S, 1), "ring_rows": np.zeros((1, 2, S, 3))}

    def decoder(feed):  # type: ignore[no-untyped-def]
        # a position's "logits" are its index; the head reads the last position, then the verified ones
        seen.add((("decoder",), feed["streams"].shape, feed["verify"].shape, feed["lora_rows"].shape))
        S = feed["streams"].shape[1]
        head = np.concatenate(([S - 1], feed["verify"][0])).astype(np.float32)[None, :, None]
        return {"logits": head[:, 0], "verify_logits": head[:, 1:], "ring_rows": np.zeros((1, 2, S, 3))}

    for steps in range(1, MAX_BLOCK + 2):
        out = run_encoder_rows(encoder, {"tokens": np.zeros((1, steps), np.int64), "start": np.zeros(1, np.int64),
                                         "rings": np.zeros((1, 2))}, pad=True)
        assert out["streams"].shape == (1, steps, 1) and out["ring_rows"].shape == (1, 2, steps, 3)
        for asked in {0, steps - 1, steps}:
            feed = {"streams": np.zeros((1, steps, 4, 2), np.float32), "ffn_pre": np.zeros((1, steps, 4), np.float32),
                    "topk": np.zeros((1, steps, 2), np.int64), "candidates": np.zeros((1, steps, 2), np.int64),
                    "verify": np.arange(asked, dtype=np.int64)[None], **lora_grid([1], steps)}
            result = run_decoder_rows(decoder, feed, {}, pad=True)
            assert result["logits"].ravel().tolist() == [steps - 1]
            assert result["verify_logits"].ravel().tolist() == list(range(asked))
            assert result["ring_rows"].shape == (1, 2, steps, 3)
    assert seen == {(("encoder",), (1, STEP_TILE)),
                    (("decoder",), (1, STEP_TILE, 4, 2), (1, HEAD_TILE - 1), (1, STEP_TILE))}, seen
