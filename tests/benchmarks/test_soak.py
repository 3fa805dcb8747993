"""The soak run, short (25 s of load): a real server under mixed load and faults must pass its own checks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.tiny import PROJECT_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # its subject is load: it runs alone, after the rest


def test_a_short_soak_run_passes(default_engines, tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = subprocess.run([sys.executable, "-m", "benchmarks", "soak", "--duration", "25", "--clients", "8",
                             "--no-doc", "--work", str(tmp_path / "soak")],
                            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert '"server_crashes": 0' in result.stdout and '"unexpected_errors": 0' in result.stdout
