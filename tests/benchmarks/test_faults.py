"""The fault benchmark's table (its drill runs in tests/tritonserver_backend/test_fault_healing.py, through a real
tritonserver): every row with its times, what did not happen shown as "-", and the kept sessions as counted."""

from __future__ import annotations

import argparse

from benchmarks.faults import SECTION, FaultRow, render


def test_the_table_shows_each_fault_as_measured() -> None:
    rows = [FaultRow("decoder", True, 2.1, 0.2, 18.4, 4, 4, 0),
            FaultRow("decoder", False, 2.3, 0.2, None, 0, 4, 1)]
    args = argparse.Namespace(sessions=4, models=["decoder"])
    text = render(args, rows)
    assert text.startswith(SECTION)
    assert "| decoder | on | 2.1 s | 0.2 s | 18.4 s | 4 / 4 | 0 |" in text
    assert "| decoder | off | 2.3 s | 0.2 s | - | 0 / 4 | 1 |" in text
    assert "Healed after 18.4-18.4 s" in text and "error came 2.1-2.3 s after the kill" in text
