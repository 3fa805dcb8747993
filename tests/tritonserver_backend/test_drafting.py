"""The n-gram drafter (prompt lookup over the reply) and the `speculative` switch's validation."""

from __future__ import annotations

import pytest

from tritonserver_backend.drafting import NgramDrafter, make_drafter
from tritonserver_backend.repository import main as render


def test_the_longest_recent_ngram_is_looked_up_and_its_continuation_drafted() -> None:
    drafter = NgramDrafter(block=4, max_ngram=3)
    assert drafter.draft([5, 6, 7, 8, 9, 5, 6, 7], 4) == [8, 9, 5, 6]  # "5 6 7" seen before: what followed it
    assert drafter.draft([1, 2, 3, 9, 2, 3, 4, 2, 3], 2) == [4, 2]  # the latest earlier "2 3", not the first one
    assert drafter.draft([1, 2, 3, 4], 4) == []  # nothing repeats
    assert drafter.draft([7, 7], 4) == [7]  # a continuation shorter than asked
    assert drafter.draft([5, 6, 5, 6], 0) == []  # no room left in the turn
    assert NgramDrafter(block=2).draft([1, 2, 3, 1, 2], 5) == [3, 1]  # at most `block`


def test_a_bad_switch_is_refused_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert make_drafter("off") is None and make_drafter("ngram", 3).block == 3
    with pytest.raises(ValueError, match="unknown drafter 'dspark'"):
        make_drafter("dspark")
    with pytest.raises(ValueError, match="speculative_block must lie in 1..7"):
        make_drafter("ngram", 8)
    with pytest.raises(SystemExit):
        render(["--out", str(tmp_path / "repo"), "--speculative", "eagle"])
    assert not (tmp_path / "repo").exists()
