"""The arena pool: two lanes whose steps alternate, with a row moving from one lane to the other, must feed the engine
exactly what stacking the rows afresh would, and keep each lane's batch arrays between its steps."""

from __future__ import annotations

import copy

import numpy as np

from ced.steps.arena_pool import ArenaPool
from ced.steps.layout import StepLayout
from ced.steps.rows import (
    DecoderRow,
    EncoderRow,
    encoder_inputs,
)
from ced.steps.step_loop import prefill_and_replay
from tests.build_engines.export.arena_steps import step_both, step_runners


def test_alternating_lanes_feed_what_fresh_stacking_feeds_and_keep_their_arrays(net) -> None:  # type: ignore[no-untyped-def]
    cfg = net.cfg
    layout, encoder, decoder, bank = step_runners(net)
    rng = np.random.default_rng(1)
    plain: dict[int, tuple[EncoderRow, DecoderRow]] = {}
    pooled: dict[int, tuple[EncoderRow, DecoderRow]] = {}
    for sid, length in enumerate((7, 33, 64, 90)):
        erow, drow = prefill_and_replay(layout, encoder, decoder, bank, rng.integers(0, cfg.vocab_size, length),
                                        chunk=length)
        plain[sid], pooled[sid] = (erow, drow), copy.deepcopy((erow, drow))
    enc_pool, dec_pool = ArenaPool(2), ArenaPool(2)
    lanes = [[0, 1], [2, 3]]
    steps = 0
    for step in range(24):
        if step == 12:  # row 1 moves to the other lane (a rebalance): both lanes restack once, nothing is lost
            lanes = [[0], [2, 3, 1]]
        active = lanes[step % 2]
        tokens = rng.integers(0, cfg.vocab_size, (len(active), 1))
        step_both(layout, encoder, decoder, bank, plain, pooled, active, tokens, enc_pool, dec_pool, f"step {step}")
        steps += 1
    for s in plain:
        (pe, pd), (ae, ad) = plain[s], pooled[s]
        assert pe.position == ae.position and np.array_equal(pe.rings, ae.rings) and np.array_equal(pd.rings, ad.rings)
        assert np.array_equal(pd.kv[:pd.position], ad.kv[:ad.position])
    # one arena per lane: a build per lane, one more per lane after the move, and store growth; not one per step
    assert enc_pool.rebuilds <= 8 and dec_pool.rebuilds <= 8, (enc_pool.rebuilds, dec_pool.rebuilds)


def test_a_single_arena_would_restack_alternating_lanes_every_step(net) -> None:  # type: ignore[no-untyped-def]
    """Why the pool exists: the same alternation through one arena rebuilds it at every step."""
    layout = StepLayout(net.cfg)
    tokens = np.zeros((2, 1), np.int64)
    rebuilds = {}
    for size in (1, 2):  # each pool its own rows: a row lives in the batch arrays of one arena at a time
        rows = [EncoderRow.empty(layout) for _ in range(4)]
        pool = ArenaPool(size)
        for step in range(10):
            encoder_inputs(layout, rows[:2] if step % 2 == 0 else rows[2:], tokens, pool)  # type: ignore[arg-type]
        rebuilds[size] = pool.rebuilds
    assert rebuilds == {1: 10, 2: 2}
