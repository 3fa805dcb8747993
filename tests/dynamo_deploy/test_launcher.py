"""The launcher's line in the suite's start log (fast; no process runs): scripts/test_durations.py counts Dynamo
deployments from it, so a line must stand for a deployment whose processes started, once."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dynamo_deploy.launcher import Deployment
from tests.conftest import EMBEDDED
from tritonserver_backend.launcher.start_log import START_LOG_ENV


def test_a_deployment_is_one_line_written_when_its_frontend_starts(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers start first and write nothing; the frontend's start writes the line; a worker restarted into the
    running deployment (the fault tests' kind of start) is no new deployment."""
    log = tmp_path / "starts.log"
    monkeypatch.setenv(START_LOG_ENV, str(log))
    spawned: list[list[str]] = []
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kwargs: spawned.append(argv) or argv)
    d = Deployment(tmp_path / "run", EMBEDDED, tmp_path / "engines", encoders=2, decoders=1)
    (d.run_dir / "logs").mkdir(parents=True)
    d.start_worker("encoder", 0)
    d.start_worker("encoder", 1)
    d.start_worker("decoder", 0)
    assert not log.exists()
    d._spawn("frontend", ["-m", "dynamo.frontend"])
    d.start_worker("decoder", 0)
    assert [line.split("\t")[1:] for line in log.read_text().splitlines()] == [["dynamo", f"{d.run_dir} (2x1)"]]
    assert len(spawned) == 5
