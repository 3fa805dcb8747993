"""Bounded replays of different lengths in one batched decoder call, bit for bit against each row's solo replay.

A batched replay pads its shorter rows at the front with inert rows and hides them with `ring_start`; each used
adapter slot's positions run as one LoRA GEMM (`lora_grid`). Both are places where one row could leak into another
or where the padding could become visible, and tokens alone would not show it (an outside review made the padding
visible: logits moved by up to 0.28 and every token-level test passed). So this compares the logits and the real
ring rows of every row, exactly, on the embedded default's served onnx engines with its trained adapters, with
replay lengths 9, 14, 40 and 128 and three rows (more than the grid's minimum of two) on one adapter slot.
"""

from __future__ import annotations

import numpy as np
import pytest

from ced.lora import AdapterBank
from ced.model.network import CEDNetwork
from ced.steps.lora_stacked import stack_adapters
from ced.steps.rows import (
    HANDOVER_KEYS,
    DecoderRow,
    EncoderRow,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
    replay_length,
)
from tests.conftest import EMBEDDED

pytestmark = pytest.mark.slow

# (tokens encoded, adapter slot): replay counts 9, 14, 40, 128 (a 300-token session replays its last 128), and
# slot 2 carries three rows of different lengths; slot 0 is the base model
ROWS = [(9, 2), (14, 2), (40, 1), (300, 2), (40, 0), (128, 3)]


@pytest.fixture(scope="module")
def engine(default_engines):  # type: ignore[no-untyped-def]
    import torch

    from tritonserver_backend.engines import open_engine

    opened = open_engine("onnx", EMBEDDED, default_engines)
    with torch.device("meta"):
        shapes_only = CEDNetwork(opened.cfg)
    adapters = AdapterBank(opened.cfg, shapes_only).load_bundled(EMBEDDED)
    assert len(adapters) >= 3, sorted(adapters)
    opened.set_lora_bank(stack_adapters(opened.layout, [None, *list(adapters.values())[:3]]))
    return opened


def _session(engine, n: int, rng: np.random.Generator) -> DecoderRow:  # type: ignore[no-untyped-def]
    """A decoder row after `n` random tokens went through the encoder (in 64-token prefill chunks)."""
    layout = engine.layout
    erow, drow = EncoderRow.empty(layout), DecoderRow.empty(layout)
    tokens = rng.integers(4, layout.cfg.vocab_size, n)
    for i in range(0, n, 64):
        ids = tokens[i:i + 64][None]
        out = engine.encoder(encoder_inputs(layout, [erow], ids))
        absorb_encoder(layout, [erow], out, ids.shape[1])
        drow.absorb(layout, {k: out[k][0] for k in HANDOVER_KEYS})
    return drow


def _replay(engine, rows: list[DecoderRow], slots: list[int]) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    feed = decoder_inputs(engine.layout, rows, None, slots)
    out = engine.decoder(feed)
    absorb_decoder(rows, out, feed, True, slots)
    return out


def test_batched_replays_of_mixed_lengths_equal_their_solo_replays_bit_for_bit(engine) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    sessions = [_session(engine, n, rng) for n, _ in ROWS]
    slots = [slot for _, slot in ROWS]
    counts = [s.replay_count for s in sessions]
    assert sorted(set(counts)) == [9, 14, 40, 128] and slots.count(2) == 3
    length = replay_length(counts, engine.cfg.window_size)
    assert length == 128, "every shorter row is front-padded in this call"

    batch = [s.clone() for s in sessions]
    batched = _replay(engine, batch, slots)
    for b, (session, slot) in enumerate(zip(sessions, slots)):
        alone = session.clone()
        solo = _replay(engine, [alone], [slot])
        n = session.replay_count
        # the last position's logits are what the turn samples from; every real position's are compared too
        np.testing.assert_array_equal(batched["logits"][b], solo["logits"][0], err_msg=f"row {b}: next-token logits")
        assert batched["ring_rows"].shape[2] == length and solo["ring_rows"].shape[2] == n
        np.testing.assert_array_equal(batched["ring_rows"][b][:, -n:], solo["ring_rows"][0],
                                      err_msg=f"row {b}: ring rows")
        np.testing.assert_array_equal(batch[b].rings, alone.rings, err_msg=f"row {b}: the rings the replay leaves")
        assert batch[b].ring_start == alone.ring_start == session.position - n
    assert len({batched["logits"][b].tobytes() for b in range(len(ROWS))}) == len(ROWS), "the rows really differ"


def test_a_replay_row_does_not_depend_on_the_other_rows_of_its_call(engine) -> None:  # type: ignore[no-untyped-def]
    """The same row next to different neighbours (other lengths, other slots) gives the same bits: nothing of a
    neighbour leaks in through the padding, the grid or the stacked stores."""
    rng = np.random.default_rng(1)
    row = _session(engine, 14, rng)
    neighbours = [[(_session(engine, n, rng), s) for n, s in group]
                  for group in ([(128, 2), (40, 2)], [(9, 1), (300, 3), (40, 2)])]
    results = []
    for group in neighbours:
        rows = [row.clone(), *(r.clone() for r, _ in group)]
        out = _replay(engine, rows, [2, *(s for _, s in group)])
        results.append((out["logits"][0], rows[0].rings))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
