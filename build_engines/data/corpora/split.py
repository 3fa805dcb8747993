"""Deterministic, seeded splits: documents by group for the LM corpora, rows by label for the labelled sets.

Why by group: parts of one long document (or chapters' parts) must not straddle train and test, or perplexity is
measured on text the model has half seen. Why sort before shuffling: archives, directory walks and dicts can list
the same files in different orders on different machines; sorting first makes the split a function of the seed
and the content names only. `random.Random` seeded with a string hashes it with SHA-512, so it is stable across
processes and Python hash seeds.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Mapping, Sequence

SPLITS = ("train", "val", "test")


def seeded_rng(seed: int, *salt: str) -> random.Random:
    """A generator that depends on the seed and on what it is used for (so sources do not share one stream)."""
    return random.Random(":".join([str(seed), *salt]))


def eval_count(n_groups: int, fraction: float, minimum: int) -> int:
    """Groups for each of val and test: `fraction` of them, at least `minimum`, but never more than a quarter."""
    if n_groups < 3:
        raise ValueError(f"need at least 3 document groups to fill train, val and test, got {n_groups}")
    wanted = max(math.ceil(fraction * n_groups), minimum)
    return max(1, min(wanted, n_groups // 4))


def split_groups(groups: Sequence[str], seed: int, salt: str, fraction: float = 0.05,
                 minimum: int = 3) -> dict[str, str]:
    """Assign each distinct group to train/val/test; val and test each get `eval_count(...)` groups."""
    ordered = sorted(set(groups))
    seeded_rng(seed, "split", salt).shuffle(ordered)
    n_eval = eval_count(len(ordered), fraction, minimum)
    assignment = {group: "val" for group in ordered[:n_eval]}
    assignment.update({group: "test" for group in ordered[n_eval : 2 * n_eval]})
    assignment.update({group: "train" for group in ordered[2 * n_eval :]})
    return assignment


def select_within_budget(sizes: Mapping[str, int], budget: int | None, seed: int, salt: str) -> set[str]:
    """The groups kept when a source must stay under `budget` characters: a seeded random subset, whole groups.

    None keeps everything. Groups are visited in a seeded order and taken while they fit, so the choice does not
    depend on which groups happen to sort first.
    """
    if budget is None or sum(sizes.values()) <= budget:
        return set(sizes)
    ordered = sorted(sizes)
    seeded_rng(seed, "budget", salt).shuffle(ordered)
    kept: set[str] = set()
    total = 0
    for group in ordered:
        if total + sizes[group] <= budget:
            kept.add(group)
            total += sizes[group]
    return kept


def stratified_split(labels: Sequence[str], seed: int, salt: str,
                     fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> list[str]:
    """A split name for each row, per label in proportion `fractions`, each label's rows shuffled with the seed.

    Labels with at least three rows get at least one row in each of val and test, so rare classes (TREC's ABBR,
    some of its 50 fine labels) are still evaluated.
    """
    if abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions must sum to 1, got {fractions}")
    by_label: dict[str, list[int]] = defaultdict(list)
    for index, label in enumerate(labels):
        by_label[label].append(index)
    result = ["train"] * len(labels)
    for label in sorted(by_label):
        rows = by_label[label]
        seeded_rng(seed, "labelled", salt, label).shuffle(rows)
        n_val = round(fractions[1] * len(rows))
        n_test = round(fractions[2] * len(rows))
        if len(rows) >= 3:
            n_val, n_test = max(n_val, 1), max(n_test, 1)
        for index in rows[:n_val]:
            result[index] = "val"
        for index in rows[n_val : n_val + n_test]:
            result[index] = "test"
    return result
