"""The exported ONNX graphs against the step modules, batch and chunk invariance, source independence on the engine
path (a tiny network with fresh random weights each run, exported once per module: about a minute)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime  # noqa: F401 - a core dependency: a broken install must fail here, not skip the engines
import pytest
import torch

from build_engines.build.onnx_build import GRAPH_FILES, random_bank
from ced.model.attention import select_top as reference_select_top
from ced.steps import graph_ops
from ced.steps.parity import HANDOVER, max_difference
from ced.steps.rows import (
    DecoderRow,
    EncoderRow,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)
from plugins import DOMAIN, PLUGIN_NAMESPACE, register_onnx_schemas

pytestmark = pytest.mark.slow


def test_graphs_pass_the_checker_and_carry_the_mol2_nodes(exported) -> None:  # type: ignore[no-untyped-def]
    register_onnx_schemas()
    expected = {"encoder": {"SparseGlobalAttention", "SwaReplayAttention"}, "decoder": {"SparseGlobalAttention"},
                "pointer": {"PointerScore"}}
    for name, ops in expected.items():
        model = onnx.load(str(exported["dir"] / GRAPH_FILES[name]))
        onnx.checker.check_model(model, full_check=True)
        nodes = [n for n in model.graph.node if n.domain == DOMAIN]
        assert {n.op_type for n in nodes} == ops, name
        for node in nodes:
            attrs = {a.name: a for a in node.attribute}
            assert attrs["plugin_namespace"].s.decode() == PLUGIN_NAMESPACE and attrs["plugin_version"].s == b"1"
            assert attrs["aot"].i == 1, "TensorRT should take the plugin's ahead-of-time kernel"
        assert ops <= {f.name for f in model.functions if f.domain == DOMAIN}, "each op's local function is in the file"
    print("build parity (max abs):", exported["parity"])


def test_engram_tables_stay_out_of_the_encoder_graph(exported) -> None:  # type: ignore[no-untyped-def]
    """With Engram the encoder graph takes the gathered rows as inputs and holds the gate's weights, but no table: the
    tables stay in the checkpoint (memory-mapped on the host), whatever their size."""
    layout = exported["layout"]
    model = onnx.load(str(exported["dir"] / GRAPH_FILES["encoder"]))
    inputs = {i.name for i in model.graph.input}
    sizes = {tuple(i.dims) for i in model.graph.initializer}
    cfg = layout.cfg
    tables = {(rows, cfg.engram_head_dim) for rows in cfg.engram_num_embeddings}
    assert {f"engram_rows_{l}" for l in layout.engram_layers} <= inputs
    assert not any(n.startswith("engram_rows_") for n in inputs - {f"engram_rows_{l}" for l in layout.engram_layers})
    assert not tables & sizes, "an Engram table is an initializer of the encoder graph"
    if layout.engram_layers:
        value_projection = (cfg.dim * (cfg.hc_mult + 1), layout.engram_cols * cfg.engram_head_dim)
        assert value_projection in sizes or value_projection[::-1] in sizes, (
            "the gate's value projection is in the graph")


def _prefill(layout, runner, rows, tokens, engram=None):  # type: ignore[no-untyped-def]
    out = runner(encoder_inputs(layout, rows, tokens, engram=engram))
    absorb_encoder(layout, rows, out, tokens.shape[1], tokens)
    return out


class _SelectionRecorder:
    """Records every (scores, selection) the eager step makes, so that a selection onnxruntime makes differently can
    be checked against the scores: a real near-tie (two scores within float rounding of each other) or a bug."""

    def __init__(self, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        self.calls: list[tuple[np.ndarray, np.ndarray]] = []

        def record(scores: torch.Tensor, k: int) -> torch.Tensor:
            picked = reference_select_top(scores, k)
            self.calls.append((scores.detach().numpy().copy(), picked.numpy().copy()))
            return picked

        monkeypatch.setattr(graph_ops, "reference_select_top", record)

    def scores_behind(self, picked: np.ndarray) -> np.ndarray:
        """The scores of the latest recorded selection that produced `picked`."""
        for scores, seen in reversed(self.calls):
            if seen.shape == picked.shape and np.array_equal(seen, picked):
                return scores
        raise AssertionError("no recorded selection produced this output")


def _swapped_only_near_ties(scores: np.ndarray, want: np.ndarray, got: np.ndarray, tol: float) -> bool:
    """Where the two selections differ slot by slot, the entries they put there score within `tol` of each other
    (the eager scores): a near-tie that float rounding may order either way. A missing entry (-1) on one side only
    is never a tie."""
    differ = want != got
    if ((want < 0) & differ).any() or ((got < 0) & differ).any():
        return False
    rows = np.nonzero(differ.any(-1))
    for b, s in zip(*rows):
        slots = differ[b, s]
        gap = np.abs(scores[b, s, want[b, s, slots]] - scores[b, s, got[b, s, slots]])
        if not (gap <= tol).all():  # a NaN gap (an infinite pin moved) is not a tie either
            return False
    return True


def test_encoder_prefill_and_decode_match_the_module(exported, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Step by step from the same state: equal selections and close floats. A selection that differs is accepted
    only as a near-tie in the eager scores, at most once per run (a wrong selection differs every step); that step's
    floats are not compared and the onnx side is resynchronised to the eager state."""
    layout, run_t, run_o = exported["layout"], exported["torch"]["encoder"], exported["onnx"]["encoder"]
    recorder = _SelectionRecorder(monkeypatch)
    rows_t, rows_o = [EncoderRow.empty(layout)], [EncoderRow.empty(layout)]
    worst: dict[str, float] = {}
    near_ties = 0
    for length in (151, 1, 1, 2, 37, 1):
        tokens = np.random.randint(0, layout.cfg.vocab_size, (1, length))
        recorder.calls.clear()
        engram = exported["engram"]
        got_t, got_o = _prefill(layout, run_t, rows_t, tokens, engram), _prefill(layout, run_o, rows_o, tokens, engram)
        diff = max_difference(got_t, got_o)
        if diff["topk"] or diff["candidates"]:
            for name in ("topk", "candidates"):
                scores = recorder.scores_behind(got_t[name])
                assert _swapped_only_near_ties(scores, got_t[name], got_o[name], tol=1e-5), f"{name}: not a near-tie"
            near_ties += 1
            print(f"near-tie in the selection at a {length}-token step: floats not compared, onnx rows resynchronised")
            rows_o = [row.clone() for row in rows_t]
            continue
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in diff.items()}
    print("encoder onnx vs torch:", worst)
    assert near_ties <= 1, "selections differ at several steps: not rounding"
    assert worst["topk"] == worst["candidates"] == 0.0, "the same entries are selected"
    assert max(worst.values()) < 1e-4


def test_decoder_replay_and_decode_with_two_adapters_in_one_batch(exported) -> None:  # type: ignore[no-untyped-def]
    layout = exported["layout"]
    enc_t, dec_t, dec_o = exported["torch"]["encoder"], exported["torch"]["decoder"], exported["onnx"]["decoder"]
    bank = random_bank(layout, slots=3, rank=4, seed=int(np.random.randint(1 << 30)))
    rows = []
    for length in (140, 201):  # both longer than the window: equal replay lengths in one batch
        erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
        out = _prefill(layout, enc_t, [erow], np.random.randint(0, layout.cfg.vocab_size, (1, length)),
                       exported["engram"])
        drow.absorb(layout, {k: out[k][0] for k in HANDOVER})
        rows.append((erow, drow))
    decoders = [[r[1] for r in rows], [r[1].clone() for r in rows]]  # torch side, onnx side
    slots = [1, 2]
    worst = 0.0
    for step in range(5):
        feeds = []
        if step:
            tokens = np.random.randint(0, layout.cfg.vocab_size, (2, 1))
            out = enc_t(encoder_inputs(layout, [r[0] for r in rows], tokens, engram=exported["engram"]))
            absorb_encoder(layout, [r[0] for r in rows], out, 1, tokens)
            new = [{k: out[k][b] for k in HANDOVER} for b in range(2)]
        for side in decoders:
            if step:
                for drow, h in zip(side, new):
                    drow.absorb(layout, h)
            feeds.append({**decoder_inputs(layout, side, None if step == 0
                                           else [{k: h[k] for k in HANDOVER[:4]} for h in new], slots), **bank})
        got_t, got_o = dec_t(feeds[0]), dec_o(feeds[1])
        for side, got, feed in zip(decoders, (got_t, got_o), feeds):
            absorb_decoder(side, got, feed, step == 0, slots)
        diff = max_difference(got_t, got_o)
        worst = max(worst, diff["logits"])
        assert (got_t["logits"].argmax(-1) == got_o["logits"].argmax(-1)).all()
    print(f"decoder onnx vs torch, two adapters in one batch, replay + 4 decode steps: max abs logit {worst:.2e}")
    assert worst < 1e-4


def test_a_batched_step_gives_each_row_exactly_its_solo_result(exported) -> None:  # type: ignore[no-untyped-def]
    """Rows at different positions, store lengths and adapters in one batch: bit for bit what each gets alone."""
    layout, enc_o, dec_o = exported["layout"], exported["onnx"]["encoder"], exported["onnx"]["decoder"]
    bank = random_bank(layout, slots=4, rank=4)
    sessions = []
    for length in (5, 130, 300, 61):
        erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
        out = _prefill(layout, enc_o, [erow], np.random.randint(0, layout.cfg.vocab_size, (1, length)),
                       exported["engram"])
        drow.absorb(layout, {k: out[k][0] for k in HANDOVER})
        feed = {**decoder_inputs(layout, [drow], None, [length % 4]), **bank}
        absorb_decoder([drow], dec_o(feed), feed, True, [length % 4])
        sessions.append((erow, drow, length % 4))
    tokens = np.random.randint(0, layout.cfg.vocab_size, (4, 1))
    solo = []
    for (erow, drow, slot), tok in zip(sessions, tokens):
        e_out = enc_o(encoder_inputs(layout, [erow.clone()], tok[None], engram=exported["engram"]))
        d = drow.clone()
        d.absorb(layout, {k: e_out[k][0] for k in HANDOVER})
        feed = {**decoder_inputs(layout, [d], [{k: e_out[k][0] for k in HANDOVER[:4]}], [slot]), **bank}
        solo.append((e_out, dec_o(feed)))
    e_rows = [s[0] for s in sessions]
    e_out = enc_o(encoder_inputs(layout, e_rows, tokens, engram=exported["engram"]))
    for b, (s_enc, _) in enumerate(solo):
        for key in HANDOVER:
            assert np.array_equal(e_out[key][b], s_enc[key][0]), f"encoder {key} of row {b} depends on the batch"
    d_rows = [s[1] for s in sessions]
    for b, d in enumerate(d_rows):
        d.absorb(layout, {k: e_out[k][b] for k in HANDOVER})
    feed = {**decoder_inputs(layout, d_rows, [{k: e_out[k][b] for k in HANDOVER[:4]} for b in range(4)],
                             [s[2] for s in sessions]), **bank}
    d_out = dec_o(feed)
    for b, (_, s_dec) in enumerate(solo):
        assert np.array_equal(d_out["logits"][b], s_dec["logits"][0]), f"decoder logits of row {b} depend on the batch"
        assert np.array_equal(d_out["ring_rows"][b], s_dec["ring_rows"][0])


def test_prefill_chunking_does_not_change_a_bit(exported) -> None:  # type: ignore[no-untyped-def]
    """A history encoded in one chunk or in pieces leaves the same state and hand-over: a session rebuilt from its
    history after a restart continues exactly."""
    layout, enc_o = exported["layout"], exported["onnx"]["encoder"]
    tokens = np.random.randint(0, layout.cfg.vocab_size, (1, 333))
    one, pieces = EncoderRow.empty(layout), EncoderRow.empty(layout)
    whole = _prefill(layout, enc_o, [one], tokens, exported["engram"])
    parts = [_prefill(layout, enc_o, [pieces], tokens[:, a:b], exported["engram"])
             for a, b in ((0, 100), (100, 101), (101, 229), (229, 333))]
    for key in HANDOVER:
        assert np.array_equal(whole[key][0], np.concatenate([p[key][0] for p in parts])), key
    assert np.array_equal(one.rings, pieces.rings) and np.array_equal(one.engram_recent, pieces.engram_recent)
    for s in layout.sources:
        used = one.used(layout, s)
        assert (np.array_equal(one.kv[s][:used], pieces.kv[s][:used])
                and np.array_equal(one.index_k[s][:used], pieces.index_k[s][:used]))


def test_replay_through_the_engine_is_independent_of_the_source_adapter(exported) -> None:  # type: ignore[no-untyped-def]
    """One history decoded under different source adapters (base, A, B), then replayed under a fixed target:
    identical logits and rings, bit for bit."""
    layout, enc_o, dec_o = exported["layout"], exported["onnx"]["encoder"], exported["onnx"]["decoder"]
    bank = random_bank(layout, slots=4, rank=4)
    history = np.random.randint(0, layout.cfg.vocab_size, (1, 150))
    later = np.random.randint(0, layout.cfg.vocab_size, (12, 1))
    erow = EncoderRow.empty(layout)
    first = _prefill(layout, enc_o, [erow], history, exported["engram"])
    steps = [_prefill(layout, enc_o, [erow], t[None], exported["engram"]) for t in later]
    for target in (1, 3):
        results = []
        for source in (0, 1, 2):
            drow = DecoderRow.empty(layout)
            drow.absorb(layout, {k: first[k][0] for k in HANDOVER})
            feed = {**decoder_inputs(layout, [drow], None, [source]), **bank}
            absorb_decoder([drow], dec_o(feed), feed, True, [source])
            for out in steps:  # the source adapter decodes the later tokens on its own rings
                drow.absorb(layout, {k: out[k][0] for k in HANDOVER})
                feed = {**decoder_inputs(layout, [drow], [{k: out[k][0] for k in HANDOVER[:4]}], [source]), **bank}
                absorb_decoder([drow], dec_o(feed), feed, False, [source])
            feed = {**decoder_inputs(layout, [drow], None, [target]), **bank}
            results.append(dec_o(feed))
        for other in results[1:]:
            assert (np.array_equal(other["logits"], results[0]["logits"])
                    and np.array_equal(other["ring_rows"], results[0]["ring_rows"]))
    assert not np.array_equal(results[0]["logits"],
                              dec_o({**decoder_inputs(layout, [drow], None, [0]), **bank})["logits"]), \
        "the target adapter does change the logits (the check is not vacuous)"


def test_the_encoder_service_carries_each_session_s_history_across_turns_and_rebuilds(exported) -> None:  # type: ignore[no-untyped-def]
    """Through the serving path (EncoderService on the engine interface, which opens the checkpoint's Engram feed):
    a second turn encodes as the same turn of a session rebuilt from its history, and differently from a
    session that starts with it (with Engram, its first n-grams reach back into the previous turn)."""
    from tritonserver_backend.core.encoder_service import EncoderService
    from tritonserver_backend.engines import open_engine

    layout = exported["layout"]
    service = EncoderService(open_engine("torch", exported["model_dir"]))
    rng = np.random.default_rng(int(np.random.randint(1 << 30)))
    first, second = (rng.integers(1, layout.cfg.vocab_size, n) for n in (23, 9))
    token = service.encode_turn("kept", first, start=True).issued_token
    service.encode_step(["kept"], first[-1:].reshape(1, 1), turn_done=True)
    kept = service.encode_turn("kept", second, session_token=token).handover
    rebuilt = service.encode_turn("rebuilt", second, prefix_ids=np.concatenate([first, first[-1:]])).handover
    fresh = service.encode_turn("fresh", second, start=True).handover
    # the torch engine's CPU GEMMs pick kernels by row count (9 rows here, 33 there): equal up to rounding
    difference = max_difference(kept, {k: rebuilt[k][-second.size:] for k in kept})
    assert difference["topk"] == difference["candidates"] == 0.0 and max(difference.values()) < 1e-5, difference
    assert np.abs(kept["streams"] - fresh["streams"]).max() > 1e-3, "the history changes the turn (not vacuous)"
    if layout.engram_layers:
        assert service.sessions.get("kept").engram_recent.tolist() == second[-layout.engram_history:].tolist()
