"""Adapter-routing scores for the report: accuracy, per class and a confusion matrix from one head's predictions.

Kept apart from training so the router stage (`router_stage.py`: the study and the shipped head) and the zero-shot
check score the two benchmarks (document windows, natural requests) the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def adapter_scores(name: str, predicted: Sequence[str], expected: Sequence[str],
                   labels: Sequence[str]) -> dict[str, float | list[list[int]]]:
    """`{name}` accuracy, `{name}:{label}` per-class accuracy and `{name}:confusion` (rows: expected label, columns:
    predicted label, both in `labels` order) from parallel lists of adapter names."""
    if len(predicted) != len(expected) or not expected:
        raise ValueError(f"{len(predicted)} predictions for {len(expected)} items")
    out: dict[str, float | list[list[int]]] = {
        name: sum(p == e for p, e in zip(predicted, expected)) / len(expected)}
    for label in labels:
        rows = [p == e for p, e in zip(predicted, expected) if e == label]
        if rows:
            out[f"{name}:{label}"] = sum(rows) / len(rows)
    index = {label: i for i, label in enumerate(labels)}
    matrix = [[0] * len(labels) for _ in labels]
    for p, e in zip(predicted, expected):
        matrix[index[e]][index[p]] += 1
    out[f"{name}:confusion"] = matrix
    return out


def mean_std(values: Sequence[float]) -> str:
    """"mean ± std" in percent over seeds (population std), or the single value."""
    if len(values) > 1:
        return f"{100 * statistics.mean(values):.2f} ± {100 * statistics.pstdev(values):.2f}"
    return f"{100 * values[0]:.2f}"


def confusion_table(matrix: Sequence[Sequence[int]], labels: Sequence[str]) -> list[str]:
    """Markdown rows of a confusion matrix: expected label per row, chosen adapter per column, row accuracy."""
    lines = ["| expected \\ routed to | " + " | ".join(labels) + " | right |",
             "|---|" + "---|" * (len(labels) + 1)]
    for i, label in enumerate(labels):
        total = sum(matrix[i])
        right = f"{100 * matrix[i][i] / total:.1f}%" if total else "-"
        lines.append(f"| {label} | " + " | ".join(str(n) for n in matrix[i]) + f" | {right} |")
    return lines
