"""Rollback of a speculative block in the engine rows (ced/steps/rows.py).

A speculative step runs the encoder and the decoder over a block [last token, draft 1 .. draft k] and keeps only the
prefix the target accepted. What must hold, bit for bit: after keeping `a` positions of the block, every piece of a
session's state (encoder rings, global-KV stores and index keys, the ratio-2 compressor's pending pair, Engram's
n-gram history; the decoder's mirror, replay window and rings) equals the state of a session that ran only those
`a` positions; and the next step, the next turn's bounded replay included, computes the same bits from either. Cut
points cover every `a` from 0 to k+1, both parities of the block's start (the ratio-2 sources pair tokens), and
two sessions cut at different points in one batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from build_engines.build.onnx_build import random_bank
from ced.steps.layout import StepLayout
from ced.steps.rows import (
    HANDOVER_FIELDS,
    HANDOVER_KEYS,
    DecoderRow,
    EncoderRow,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)
from ced.steps.step_loop import prefill_and_replay
from tests.tiny import tiny_network

BLOCK = 5  # the last sampled token and four drafts, DSpark's block size
SLOT = 1  # every step under a random adapter

pytestmark = pytest.mark.slow  # the graphs are exported once per run (conftest)


@pytest.fixture
def engines(exported):  # type: ignore[no-untyped-def]
    """The tiny network's onnx graphs (conftest `exported`: plain and with Engram) and a random adapter in slot 1.
    The graphs, not the step modules: onnxruntime gives a position the same bits in any chunk (docs/engines.md), which
    is what lets a cut block equal a shorter one; PyTorch's CPU GEMM picks kernels by row count."""
    layout = exported["layout"]
    bank = random_bank(layout, slots=2, rank=2)
    return layout, exported["onnx"]["encoder"], exported["onnx"]["decoder"], bank, exported["engram"]


def _session(engines, length: int, seed: int) -> tuple[EncoderRow, DecoderRow]:  # type: ignore[no-untyped-def]
    layout, encoder, decoder, bank, engram = engines
    tokens = np.random.default_rng(seed).integers(0, layout.cfg.vocab_size, length)
    return prefill_and_replay(layout, encoder, decoder, bank, tokens, chunk=16, slot=SLOT, engram=engram)


def _step(engines, rows: list[tuple[EncoderRow, DecoderRow]], tokens: np.ndarray,  # type: ignore[no-untyped-def]
          keep: list[int] | None, verify: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One encoder + decoder step of `tokens` (B, S); with `keep`, a speculative one cut at keep[b] per row."""
    layout, encoder, decoder, bank, engram = engines
    erows, drows = [r[0] for r in rows], [r[1] for r in rows]
    out = encoder(encoder_inputs(layout, erows, tokens, engram=engram))
    absorb_encoder(layout, erows, out, tokens.shape[1], tokens, keep)
    handovers = [{k: out[k][b] for k in HANDOVER_KEYS} for b in range(len(rows))]
    for drow, h in zip(drows, handovers):
        (drow.absorb if keep is None else drow.absorb_draft)(layout, h)
    slots = [SLOT] * len(rows)
    feed = decoder_inputs(layout, drows, [{f: h[f] for f in HANDOVER_FIELDS} for h in handovers], slots, verify=verify)
    result = decoder({**feed, **bank})
    absorb_decoder(drows, result, feed, False, slots, keep)
    if keep is not None:
        for drow, h, k in zip(drows, handovers, keep):
            drow.settle(layout, h, k)
    return {**{f"enc.{k}": v for k, v in out.items()}, **{f"dec.{k}": v for k, v in result.items()}}


def _assert_same_state(layout: StepLayout, got: tuple[EncoderRow, DecoderRow], want: tuple[EncoderRow, DecoderRow],
                       what: str) -> None:
    (ge, gd), (we, wd) = got, want
    assert ge.position == we.position and gd.position == wd.position, what
    assert np.array_equal(ge.rings, we.rings), f"{what}: encoder rings"
    assert np.array_equal(ge.engram_recent, we.engram_recent), f"{what}: n-gram history"
    for s in layout.sources:
        used = we.used(layout, s)
        for name, a, b in (("kv", ge.kv[s], we.kv[s]), ("index_k", ge.index_k[s], we.index_k[s])):
            assert np.array_equal(a[:used], b[:used]), f"{what}: source {s} {name}"
            assert not a[used:].any(), f"{what}: source {s} {name} holds entries past the kept positions"
        if s in we.pending:
            assert np.array_equal(ge.pending[s], we.pending[s]), f"{what}: source {s} pending pair"
    n = wd.position
    assert np.array_equal(gd.kv[:n], wd.kv[:n]) and np.array_equal(gd.index_k[:n], wd.index_k[:n]), f"{what}: mirror"
    assert not gd.kv[n:].any() and not gd.index_k[n:].any(), f"{what}: the mirror holds rejected rows"
    for f in HANDOVER_FIELDS:
        assert np.array_equal(gd.recent[f], wd.recent[f]), f"{what}: replay window {f}"
    assert np.array_equal(gd.rings, wd.rings) and gd.ring_start == wd.ring_start, f"{what}: decoder rings"


def _same_outputs(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), f"{what}: {k}"


@pytest.mark.parametrize("history", [37, 36])  # the block starts at an odd / even position (ratio-2 pairing)
def test_a_cut_block_leaves_the_state_of_never_drafting_it(engines, history: int) -> None:  # type: ignore[no-untyped-def]
    layout = engines[0]
    block = np.random.default_rng(history).integers(0, layout.cfg.vocab_size, (1, BLOCK))
    base = _session(engines, history, seed=history)
    follow = np.array([[7]])
    for kept in range(BLOCK + 1):
        drafted = (base[0].clone(), base[1].clone())
        _step(engines, [drafted], block, keep=[kept])
        plain = (base[0].clone(), base[1].clone())
        if kept:
            _step(engines, [plain], block[:, :kept], keep=None)
        _assert_same_state(layout, drafted, plain, f"history {history}, kept {kept}")
        # the next token's step reads the state: same bits from both
        _same_outputs(_step(engines, [drafted], follow, None), _step(engines, [plain], follow, None),
                      f"next step after keeping {kept}")


def test_a_block_verifies_each_position_as_single_steps_decode_it(engines) -> None:  # type: ignore[no-untyped-def]
    """`verify_logits` of a block step are, position by position, the logits one-token steps give after each token:
    what makes greedy speculative decoding give the plain tokens bit for bit. Two rows in one batch."""
    layout = engines[0]
    sessions = [_session(engines, 29, seed=8), _session(engines, 34, seed=9)]
    block = np.random.default_rng(10).integers(0, layout.cfg.vocab_size, (2, BLOCK))
    drafted = [(e.clone(), d.clone()) for e, d in sessions]
    verified = _step(engines, drafted, block, keep=[BLOCK, BLOCK], verify=np.tile(np.arange(BLOCK), (2, 1)))
    assert verified["dec.verify_logits"].shape == (2, BLOCK, layout.cfg.vocab_size)
    assert verified["dec.logits"].tobytes() == verified["dec.verify_logits"][:, -1].tobytes()
    for row, (e, d) in enumerate(sessions):
        plain = (e.clone(), d.clone())
        for i in range(BLOCK):
            single = _step(engines, [plain], block[row:row + 1, i:i + 1], keep=None)
            assert single["dec.verify_logits"].shape == (1, 0, layout.cfg.vocab_size)
            assert single["dec.logits"][0].tobytes() == verified["dec.verify_logits"][row, i].tobytes(), (row, i)
        _assert_same_state(layout, drafted[row], plain, f"row {row}, whole block kept")


def test_rows_of_one_batch_are_cut_at_their_own_points(engines) -> None:  # type: ignore[no-untyped-def]
    layout = engines[0]
    a, b = _session(engines, 21, seed=1), _session(engines, 30, seed=2)
    block = np.random.default_rng(3).integers(0, layout.cfg.vocab_size, (2, BLOCK))
    drafted = [(a[0].clone(), a[1].clone()), (b[0].clone(), b[1].clone())]
    _step(engines, drafted, block, keep=[1, 4])
    for row, original, kept in ((0, a, 1), (1, b, 4)):
        plain = (original[0].clone(), original[1].clone())
        _step(engines, [plain], block[row:row + 1, :kept], keep=None)
        _assert_same_state(layout, drafted[row], plain, f"row {row} kept {kept}")


def test_a_replay_after_a_cut_block_is_the_replay_of_the_kept_history(engines) -> None:  # type: ignore[no-untyped-def]
    """The next turn (or an adapter switch) replays the last W hand-over rows: the window must hold no rejected row."""
    layout, _, decoder, bank, _ = engines
    base = _session(engines, 40, seed=5)
    block = np.random.default_rng(6).integers(0, layout.cfg.vocab_size, (1, BLOCK))
    drafted, plain = (base[0].clone(), base[1].clone()), (base[0].clone(), base[1].clone())
    _step(engines, [drafted], block, keep=[2])
    _step(engines, [plain], block[:, :2], keep=None)
    outs = []
    for _, drow in (drafted, plain):
        feed = {**decoder_inputs(layout, [drow], None, [SLOT]), **bank}
        result = decoder(feed)
        absorb_decoder([drow], result, feed, True, [SLOT])
        outs.append(result)
    _same_outputs(*outs, "replay")
    _assert_same_state(layout, drafted, plain, "after the replay")


def test_keep_is_checked() -> None:
    net = tiny_network()
    layout = StepLayout(net.cfg)
    with pytest.raises(ValueError, match="keep must give"):
        absorb_encoder(layout, [EncoderRow.empty(layout)], {}, 3, None, keep=[4])
    with pytest.raises(ValueError, match="keep applies to decode steps"):
        absorb_decoder([DecoderRow.empty(layout)], {}, {}, True, [0], keep=[1])
