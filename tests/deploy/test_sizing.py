"""The GPU count of the GPU overlays comes from the memory planner (deploy/sizing.py): the rule, and the planner's
figures kept in each overlay's sizing.json (the slow test re-runs the planner to keep them current)."""

from __future__ import annotations

import dataclasses

import pytest

from deploy.sizing import GIB, PlannerFigures, SizingInputs, bytes_needed, gpus_needed, planner_figures, read_record
from tests.deploy.checks import K8S

RECORDS = {name: K8S / "overlays" / name / "sizing.json" for name in ("gpu", "gpu-tp")}


def test_the_rule_rounds_up_to_a_power_of_two() -> None:
    inputs = SizingInputs("p", "release", "test GPU", gpu_memory_gib=100, sessions=0, context=0, usable_fraction=1.0)
    counts = [gpus_needed(inputs, PlannerFigures(int(w * GIB), 0.0, 0)) for w in (1, 100, 101, 250, 300, 401, 900)]
    assert counts == [1, 1, 2, 4, 4, 8, 16]
    # sessions count their global KV twice (encoder state + decoder mirror) and their rings once
    with_sessions = dataclasses.replace(inputs, sessions=3, context=1000)
    assert bytes_needed(with_sessions, PlannerFigures(0, 10.0, 7)) == 3 * (2 * 1000 * 10.0 + 7)


def test_the_flash_tp_group_needs_more_gpus_with_more_sessions_or_smaller_gpus() -> None:
    inputs, figures, gpus = read_record(RECORDS["gpu-tp"])
    assert inputs.preset == "deepseek-v4.1-flash" and gpus == gpus_needed(inputs, figures) == 4
    assert gpus_needed(dataclasses.replace(inputs, gpu_memory_gib=79.6), figures) == 4  # 80 GB GPUs: 3.98 of them
    assert gpus_needed(dataclasses.replace(inputs, gpu_memory_gib=45), figures) == 8  # 48 GB GPUs
    assert gpus_needed(dataclasses.replace(inputs, sessions=2000), figures) == 8  # 2000 x 128K contexts
    assert figures.weight_bytes > 0.95 * bytes_needed(inputs, figures)  # the weights dominate at 32 sessions


@pytest.mark.slow
@pytest.mark.parametrize("overlay", sorted(RECORDS))
def test_the_recorded_planner_figures_are_current(overlay: str) -> None:
    inputs, figures, _ = read_record(RECORDS[overlay])
    assert planner_figures(inputs.preset, inputs.weights) == figures, (
        f"re-run: python -m deploy.sizing ... --write {RECORDS[overlay]} (docs/deploy.md)"
    )
