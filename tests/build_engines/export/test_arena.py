"""The step arena: a batch that keeps its stacked state between steps must feed the engine exactly what stacking the
rows afresh would, through joins, departures, stores outgrowing their length, replays and a rolled-back row."""

from __future__ import annotations

import copy

import numpy as np

from ced.steps.arena import StepArena
from ced.steps.rows import (
    DecoderRow,
    EncoderRow,
    absorb_decoder,
    decoder_inputs,
)
from ced.steps.step_loop import prefill_and_replay
from tests.build_engines.export.arena_steps import step_both, step_runners


def test_arena_feeds_equal_fresh_stacking_through_joins_leaves_growth_and_rollback(net) -> None:  # type: ignore[no-untyped-def]
    cfg = net.cfg
    layout, encoder, decoder, bank = step_runners(net)
    rng = np.random.default_rng(0)
    # two universes of the same sessions: "plain" stacks rows every step, "arena" keeps batch arrays
    plain: dict[int, tuple[EncoderRow, DecoderRow]] = {}
    arena_rows: dict[int, tuple[EncoderRow, DecoderRow]] = {}
    enc_arena, dec_arena = StepArena(), StepArena()

    def start(sid: int, length: int) -> None:
        erow, drow = prefill_and_replay(layout, encoder, decoder, bank, rng.integers(0, cfg.vocab_size, length),
                                        chunk=64)
        plain[sid] = (erow, drow)
        arena_rows[sid] = copy.deepcopy((erow, drow))

    steps = 0
    active = [0, 1, 2]
    for sid, length in zip(active, (5, 60, 125)):  # the longest crosses a padded store length within a few steps
        start(sid, length)
    for step in range(40):
        if step == 8:  # a session joins
            start(3, 30)
            active.append(3)
        if step == 16:  # one leaves
            active.remove(1)
        if step == 24:  # a rollback puts back an older copy of a row (what the encoder service does)
            arena_rows[2] = copy.deepcopy(arena_rows[2])
        if step == 30:  # a new turn: bounded replay rebuilds one row's rings
            for universe in (plain, arena_rows):
                drow = universe[0][1]
                feed = {**decoder_inputs(layout, [drow], None, [0]), **bank}
                absorb_decoder([drow], decoder(feed), feed, True, [0])
        tokens = rng.integers(0, cfg.vocab_size, (len(active), 1))
        step_both(layout, encoder, decoder, bank, plain, arena_rows, active, tokens, enc_arena, dec_arena,
                  f"step {step}")
        steps += 1
    for s in plain:  # the rows' own state (what sessions store) is the same in both universes, departed rows included
        (pe, pd), (ae, ad) = plain[s], arena_rows[s]
        assert pe.position == ae.position and pd.position == ad.position
        assert np.array_equal(pe.rings, ae.rings) and np.array_equal(pd.rings, ad.rings)
        for src in layout.sources:
            used = pe.used(layout, src)
            assert (np.array_equal(pe.kv[src][:used], ae.kv[src][:used])
                    and np.array_equal(pe.index_k[src][:used], ae.index_k[src][:used]))
        assert np.array_equal(pd.kv[:pd.position], ad.kv[:ad.position])
    # the point of the arena: most steps reuse the batch arrays
    # (rebuilds on joins, departures, growth, rollback, replay)
    assert enc_arena.rebuilds < steps // 3 and dec_arena.rebuilds < steps // 3, (enc_arena.rebuilds, dec_arena.rebuilds)
