"""The n-gram drafter (prompt lookup over the reply), the DSpark drafter's block cut, and the `speculative` switch's
validation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ced.model.dspark_spec import DSparkSpec
from tests.tiny import tiny_config
from tritonserver_backend.core.decoder_service import DraftRing
from tritonserver_backend.core.drafting import DSparkDrafter, NgramDrafter, make_drafter
from tritonserver_backend.repository import main as render


def test_the_longest_recent_ngram_is_looked_up_and_its_continuation_drafted() -> None:
    drafter = NgramDrafter(block=4, max_ngram=3)
    assert drafter.draft([5, 6, 7, 8, 9, 5, 6, 7], 4) == [8, 9, 5, 6]  # "5 6 7" seen before: what followed it
    assert drafter.draft([1, 2, 3, 9, 2, 3, 4, 2, 3], 2) == [4, 2]  # the latest earlier "2 3", not the first one
    assert drafter.draft([1, 2, 3, 4], 4) == []  # nothing repeats
    assert drafter.draft([7, 7], 4) == [7]  # a continuation shorter than asked
    assert drafter.draft([5, 6, 5, 6], 0) == []  # no room left in the turn
    assert NgramDrafter(block=2).draft([1, 2, 3, 1, 2], 5) == [3, 1]  # at most `block`


class ScriptedDrafterEngine:
    """What `DSparkDrafter` needs of an engine: a layout with a drafter spec and a drafter call, which here returns
    fixed drafts and scores and records what it was fed."""

    def __init__(self, with_drafter: bool = True) -> None:
        self.cfg = tiny_config()
        self.layout = SimpleNamespace(drafter=DSparkSpec.scaled(self.cfg) if with_drafter else None)
        self.fed: list[dict[str, np.ndarray]] = []

    def drafter(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.fed.append(feed)
        B = feed["main_x"].shape[0]
        tokens = np.tile(np.arange(10, 15, dtype=np.int64), (B, 1))
        scores = np.tile(np.array([3.0, 1.0, -0.5, 2.0, 2.0], np.float32), (B, 1))  # sigmoid: .95 .73 .38 .88 .88
        return {"draft_tokens": tokens, "draft_confidence": scores}


def _turn(rows: int, last_position: int, last_token: int, dim: int):  # type: ignore[no-untyped-def]
    ring = DraftRing(np.arange(rows * dim, dtype=np.float32).reshape(rows, dim), last_position) if rows else None
    return SimpleNamespace(draft_ring=ring, generated=[1, last_token])


def test_the_dspark_drafter_feeds_each_turns_ring_and_cuts_blocks_at_low_confidence() -> None:
    engine = ScriptedDrafterEngine()
    dim, W = engine.cfg.dim, engine.cfg.window_size
    turns = [_turn(3, 40, 7, dim), _turn(W, 300, 8, dim), _turn(0, 0, 9, dim), _turn(2, 5, 6, dim)]
    assert DSparkDrafter(engine, block=4).propose(turns, [4, 2, 4, 0]) == [[10, 11, 12, 13], [10, 11], [], []]
    fed = engine.fed[-1]  # only the turns that asked and have rows were fed, each ring left-aligned, oldest first
    assert fed["main_count"].tolist() == [3, W] and fed["last_position"].tolist() == [40, 300]
    assert fed["last_token"].tolist() == [7, 8]
    assert np.array_equal(fed["main_x"][0, :3], turns[0].draft_ring.rows) and not fed["main_x"][0, 3:].any()
    cut = DSparkDrafter(engine, block=5, confidence=0.5).propose(turns[:1], [5])
    assert cut == [[10, 11]]  # the third draft's confidence (.38) is below .5: the block ends before it
    assert DSparkDrafter(engine, block=5, confidence=0.9).propose(turns[:1], [5]) == [[10]]


def test_a_ring_keeps_the_newest_window_rows() -> None:
    ring = DraftRing(np.zeros((2, 3), np.float32), 1)
    ring.extend(np.ones((3, 3), np.float32), 4, window=4)
    assert ring.count == 4 and ring.last_position == 4 and ring.rows[:, 0].tolist() == [0, 1, 1, 1]


def test_a_bad_switch_is_refused_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert make_drafter("off") is None and make_drafter("ngram", 3).block == 3
    assert make_drafter("auto") is None and make_drafter("auto", 4, ScriptedDrafterEngine(False)) is None
    assert isinstance(make_drafter("auto", 4, ScriptedDrafterEngine()), DSparkDrafter)
    with pytest.raises(ValueError, match="unknown drafter 'eagle'"):
        make_drafter("eagle")
    with pytest.raises(ValueError, match="hold no DSpark drafter"):
        make_drafter("dspark", 4, ScriptedDrafterEngine(False))
    with pytest.raises(ValueError, match="speculative_confidence must lie in"):
        make_drafter("dspark", 4, ScriptedDrafterEngine(), confidence=1.0)
    with pytest.raises(ValueError, match="speculative_block must lie in 1..7"):
        make_drafter("ngram", 8)
    for bad in (["--speculative", "eagle"], ["--speculative-confidence", "1.5"]):
        with pytest.raises(SystemExit):
            render(["--out", str(tmp_path / "repo"), *bad])
    assert not (tmp_path / "repo").exists()
