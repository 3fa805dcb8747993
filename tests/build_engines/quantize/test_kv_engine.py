"""The embedded default's fp8 engine with fp8 KV state (`--quant fp8 --kv-quant fp8`), run by the serving runtime
(`OnnxEngine`): what the graphs take and give, where the scales come from, and that the fp32 engines' invariances
survive the quantized state: a batched step equals each row's solo step bit for bit, prefill chunking changes no bit,
and the decoder's mirror holds exactly the encoder's codes. Also the state bytes a session holds, and that the fp8
state changes what the same weights compute (against the weights-only fp8 build, which this module builds or reuses
itself)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from build_engines.build.cli import main as build
from build_engines.build.onnx_build import GRAPH_FILES
from build_engines.quantize.heldout import load_heldout, token_sequences
from build_engines.quantize.scoring import bundled_adapters, sequence_nll
from ced.steps.arena import StepArena
from ced.steps.layout import StepLayout
from ced.steps.parity import HANDOVER
from ced.steps.rows import (
    FP8_MAX,
    DecoderRow,
    EncoderRow,
    KVStateLayout,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
    fp8_decode,
)
from tests.conftest import DEFAULT_ENGINES, EMBEDDED
from tritonserver_backend.engines.onnx_engine import OnnxEngine

pytestmark = pytest.mark.slow
FP8_STATE = {"encoder": ({"rings", "kv_2", "kv_4"}, {"ring_rows", "new_kv_2"}),
             "decoder": ({"rings", "kv"}, {"ring_rows"})}


def built_engine(name: str, flags: list[str], fp32_dir: Path) -> OnnxEngine:
    """`artifacts/engines/<name>` built from the fp32 graphs or reused when current (the build CLI takes the
    directory's lock, so workers asking for the same directory take turns and the second reuses it), opened by the
    serving runtime with the bundled adapters bound."""
    out = DEFAULT_ENGINES.parent / name
    code = build(["--model", str(EMBEDDED), "--out", str(out), *flags, "--reuse-fp32", str(fp32_dir)])
    assert code == 0, f"python -m build_engines build {' '.join(flags)} exited {code}"
    engine = OnnxEngine(EMBEDDED, out, threads=1)
    engine.set_lora_bank(bundled_adapters(EMBEDDED, engine.layout).bank)
    return engine


@pytest.fixture(scope="module")
def kv_engine(default_engines) -> OnnxEngine:  # type: ignore[no-untyped-def]
    return built_engine("mol2-small-fp8-kv8", ["--quant", "fp8", "--kv-quant", "fp8"], default_engines)


@pytest.fixture(scope="module")
def fp8_engine(default_engines) -> OnnxEngine:  # type: ignore[no-untyped-def]
    """The weights-only fp8 build: the fp8-KV build's weights with fp32 state, the reference of the state's effect."""
    return built_engine("mol2-small-fp8", ["--quant", "fp8"], default_engines)


def prefill(engine, row: EncoderRow, tokens: np.ndarray) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    out = engine.encoder(encoder_inputs(engine.layout, [row], tokens[None]))
    absorb_encoder(engine.layout, [row], out, tokens.size)
    return {k: out[k][0] for k in HANDOVER}


def test_state_crosses_the_graph_boundary_as_fp8_with_the_calibrated_scales(kv_engine) -> None:  # type: ignore[no-untyped-def]
    kv = kv_engine.manifest["quant"]["kv_cache"]
    assert kv_engine.manifest["settings"]["kv_quant"] == "fp8" and isinstance(kv_engine.layout, KVStateLayout)
    scales, amax = kv["scales"], kv["amax"]
    for key in ("encoder_rings", "decoder_rings"):
        assert scales[key] == [float(np.float32(a / FP8_MAX)) for a in amax[key]]
    assert {int(s): v for s, v in scales["stores"].items()} == {int(s): float(np.float32(a / FP8_MAX))
                                                                for s, a in amax["stores"].items()}
    for name, (inputs, outputs) in FP8_STATE.items():
        model = onnx.load(str(kv_engine.engine_dir / GRAPH_FILES[name]))
        fp8 = {v.name for v in list(model.graph.input) + list(model.graph.output)
               if v.type.tensor_type.elem_type == TensorProto.FLOAT8E4M3FN}
        assert fp8 == inputs | outputs, f"{name}: fp8 state tensors"
        inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        assert inits["rings.kv_scale"].tolist() == scales[f"{name}_rings"]
        global_out = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}.get("global_kv")
        assert global_out in (None, TensorProto.FLOAT), "the hand-over stays fp32 (the serving contract's type)"
    assert all(abs(f["relative"]) <= 0.02 for f in kv_engine.manifest["quant"]["check"]["perplexity"].values())


def test_fp8_state_changes_what_the_same_weights_compute(kv_engine, fp8_engine) -> None:  # type: ignore[no-untyped-def]
    """Not vacuous: the fp8-KV engine holds the weights-only fp8 engine's quantized weights (same calibration, same
    PTQ), so what tells them apart is the state; on held-out text longer than the window (rings wrap, global KV is
    read) they score differently, and so did their build checks."""
    for name in ("encoder", "decoder"):
        weights, kv_graph = ({t.name: t for t in onnx.load(str(e.engine_dir / GRAPH_FILES[name])).graph.initializer}
                             for e in (fp8_engine, kv_engine))
        assert all(kv_graph[n].SerializeToString() == t.SerializeToString() for n, t in weights.items()), name
    text = token_sequences(load_heldout(EMBEDDED, "test"), EMBEDDED / "tokenizer.json", 256, 1)["design"][0]
    slot = bundled_adapters(EMBEDDED, kv_engine.layout).slot_of_kind["design"]
    fp32_state, fp8_state = (sequence_nll(e.layout, e.encoder, e.decoder, {}, text, slot)  # banks are bound
                             for e in (fp8_engine, kv_engine))
    assert not np.array_equal(fp32_state, fp8_state), "fp8 state changes the engine's next-token scores"
    assert abs(fp8_state.mean() - fp32_state.mean()) < np.log1p(0.02), "within the 2% perplexity bound on this text"
    checks = [e.manifest["quant"]["check"]["perplexity"] for e in (fp8_engine, kv_engine)]
    assert any(checks[0][k]["fp8"] != checks[1][k]["fp8"] for k in checks[0]), "the build checks differ too"


def test_rows_keep_a_quarter_of_the_state_bytes(kv_engine) -> None:  # type: ignore[no-untyped-def]
    from tritonserver_backend.engines.onnx_engine import OnnxEngine

    fp32_engine = OnnxEngine(EMBEDDED, DEFAULT_ENGINES, threads=1)
    tokens = np.random.default_rng(0).integers(0, kv_engine.cfg.vocab_size, 300)
    rows = {}
    for name, engine in (("fp32", fp32_engine), ("fp8", kv_engine)):
        erow, drow = EncoderRow.empty(engine.layout), DecoderRow.empty(engine.layout)
        drow.absorb(engine.layout, prefill(engine, erow, tokens))
        rows[name] = erow, drow
    (e32, d32), (e8, d8) = rows["fp32"], rows["fp8"]
    assert e8.rings.dtype == np.uint8 and d8.rings.dtype == np.uint8 and d8.kv.dtype == np.uint8
    assert all(e8.kv[s].dtype == np.uint8 and e8.kv[s].nbytes * 4 == e32.kv[s].nbytes for s in e8.kv)
    assert e8.rings.nbytes * 4 == e32.rings.nbytes and d8.kv.nbytes * 4 == d32.kv.nbytes
    assert all(e8.index_k[s].dtype == np.float32 for s in e8.index_k), "index keys stay fp32"
    saved = (e32.nbytes() + d32.nbytes()) - (e8.nbytes() + d8.nbytes())
    quantized = e32.rings.nbytes + sum(a.nbytes for a in e32.kv.values()) + d32.kv.nbytes + d32.rings.nbytes
    assert saved == quantized * 3 // 4


def test_the_mirror_holds_the_encoders_codes_and_the_handover_lies_on_the_grid(kv_engine) -> None:  # type: ignore[no-untyped-def]
    layout = kv_engine.layout
    E, scale = layout.cfg.first_decoder_layer, layout.kv.handover_scale
    erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
    handover = prefill(kv_engine, erow, np.random.default_rng(1).integers(0, layout.cfg.vocab_size, 90))
    drow.absorb(layout, handover)
    assert np.array_equal(drow.kv[:90], erow.kv[E][:90])
    assert np.array_equal(fp8_decode(drow.kv[:90], scale).view(np.uint32), handover["global_kv"].view(np.uint32))
    assert len(np.unique(drow.kv[:90])) > 100, "the codes are spread over the format (the scale fits the values)"


def test_prefill_chunking_changes_no_bit_of_the_fp8_state(kv_engine) -> None:  # type: ignore[no-untyped-def]
    """Each step attends to the values it stores (rounded where produced), so chunks give the one-chunk state."""
    layout = kv_engine.layout
    tokens = np.random.default_rng(2).integers(0, layout.cfg.vocab_size, 170)
    one, pieces = EncoderRow.empty(layout), EncoderRow.empty(layout)
    whole = prefill(kv_engine, one, tokens)
    parts = [prefill(kv_engine, pieces, tokens[a:b]) for a, b in ((0, 37), (37, 38), (38, 150), (150, 170))]
    assert np.array_equal(one.rings, pieces.rings)
    for s in layout.sources:
        n = one.used(layout, s)
        assert (np.array_equal(one.kv[s][:n], pieces.kv[s][:n])
                and np.array_equal(one.index_k[s][:n], pieces.index_k[s][:n]))
    for k in HANDOVER:
        assert np.array_equal(whole[k], np.concatenate([p[k] for p in parts])), k


def test_batched_steps_equal_solo_steps_bit_for_bit(kv_engine) -> None:  # type: ignore[no-untyped-def]
    """Three sessions at different positions under different adapters: one batched encoder + decoder step (through the
    step arena, as the services run them) gives each row what its solo step gives, state included."""
    layout = kv_engine.layout
    rng = np.random.default_rng(3)
    sessions = []
    for length, slot in ((40, 1), (131, 3), (77, 0)):
        erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
        drow.absorb(layout, prefill(kv_engine, erow, rng.integers(0, layout.cfg.vocab_size, length)))
        feed = decoder_inputs(layout, [drow], None, [slot])
        absorb_decoder([drow], kv_engine.decoder(feed), feed, True, [slot])
        sessions.append((erow, drow, slot))
    token = rng.integers(0, layout.cfg.vocab_size, (3, 1))

    def step(group: list[tuple[EncoderRow, DecoderRow, int]], tokens: np.ndarray,  # type: ignore[no-untyped-def]
             arenas: tuple[StepArena, StepArena] | None):
        erows, drows, slots = [g[0] for g in group], [g[1] for g in group], [g[2] for g in group]
        out = kv_engine.encoder(encoder_inputs(layout, erows, tokens, arenas and arenas[0]))
        absorb_encoder(layout, erows, out, 1)
        rows = [{k: out[k][b] for k in HANDOVER} for b in range(len(group))]
        for d, r in zip(drows, rows):
            d.absorb(layout, r)
        feed = decoder_inputs(layout, drows, [{k: r[k] for k in HANDOVER[:4]} for r in rows], slots,
                              arenas and arenas[1])
        result = kv_engine.decoder(feed)
        absorb_decoder(drows, result, feed, False, slots)
        return result["logits"]

    solo = [(e.clone(), d.clone(), s) for e, d, s in sessions]
    batched = [(e.clone(), d.clone(), s) for e, d, s in sessions]
    alone = np.concatenate([step([g], token[b:b + 1], None) for b, g in enumerate(solo)])
    together = step(batched, token, (StepArena(), StepArena()))
    assert np.array_equal(alone, together)
    for (e1, d1, _), (e2, d2, _) in zip(solo, batched):
        assert np.array_equal(e1.rings, e2.rings) and np.array_equal(d1.rings, d2.rings)
        assert np.array_equal(d1.kv[:d1.position], d2.kv[:d2.position])
        for s in layout.sources:
            n = e1.used(layout, s)
            assert np.array_equal(e1.kv[s][:n], e2.kv[s][:n])


def test_fp32_rows_are_refused_by_the_fp8_engine(kv_engine) -> None:  # type: ignore[no-untyped-def]
    """Rows made with the fp32 layout cannot reach an fp8-state engine by mistake (the error names the fix)."""
    row = EncoderRow.empty(StepLayout(kv_engine.cfg))
    with pytest.raises(TypeError, match="uint8 fp8 codes"):
        kv_engine.encoder(encoder_inputs(kv_engine.layout, [row], np.zeros((1, 3), np.int64)))


def test_prefix_cache_hits_and_resting_sessions_keep_the_fp8_state_exact(kv_engine) -> None:  # type: ignore[no-untyped-def]
    """With fp8 state, a session that starts from the encoder's prefix cache, and one that rests on its cached prefix
    between turns and wakes for the next, hold the codes and give the rows of the same sessions without the cache."""
    from tritonserver_backend.core.encoder_service import EncoderService
    from tritonserver_backend.core.resting_rows import RestingRow, wake

    layout = kv_engine.layout
    rng = np.random.default_rng(5)
    shared = rng.integers(5, layout.cfg.vocab_size, 560)
    tails = {s: rng.integers(5, layout.cfg.vocab_size, 30 + 7 * i) for i, s in enumerate("ab")}
    later = rng.integers(5, layout.cfg.vocab_size, 20)
    services = {"cached": EncoderService(kv_engine, session_auth=False, prefix_cache_bytes=256 << 20),
                "cold": EncoderService(kv_engine, session_auth=False)}
    rows = {}
    for name, service in services.items():
        for s in "ab":
            service.encode_turn(s, np.concatenate([shared, tails[s]]), start=True)
            service.encode_step([s], np.zeros((1, 0), np.int64), turn_done=True)  # the turn ends: a rests
        rows[name] = service.encode_turn("a", later).handover  # a wakes for its next turn
    assert services["cached"].prefix_cache.counters.get("prefix_cache_hits") == 1
    assert isinstance(services["cached"].sessions.get("b"), RestingRow)
    for k in (*HANDOVER, "positions"):
        assert np.array_equal(rows["cached"][k], rows["cold"][k]), k
    for s in "ab":
        one, other = (services[name].sessions.get(s) for name in ("cached", "cold"))
        one = wake(one, layout) if isinstance(one, RestingRow) else one
        assert np.array_equal(one.rings, other.rings) and one.position == other.position
        for source in layout.sources:
            n = one.used(layout, source)
            assert np.array_equal(one.kv[source][:n], other.kv[source][:n]), (s, source)
            assert np.array_equal(one.index_k[source][:n], other.index_k[source][:n]), (s, source)
