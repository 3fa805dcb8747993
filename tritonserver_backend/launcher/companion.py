"""A second child of the supervisor (the OpenAI frontend): started after Triton is ready, restarted when it exits.

Why here and not in a second supervisor: the frontend is useless without Triton and the pod is only ready when both
are, so one process owns both and one readiness answer covers both. The frontend keeps running across a Triton
restart (same gRPC port; its channel reconnects), so only its own exit restarts it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from tritonserver_backend.launcher.net import HOST


class Companion:
    """One child process in a session of its own (SIGTERM/SIGKILL reach whatever it spawns), output to ``log_file``."""

    def __init__(self, name: str, argv: Sequence[str], log_file: Path | str, cwd: Path | str | None = None,
                 port: int | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_file = Path(log_file)
        self.cwd = cwd
        self.port = port
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> "Companion":
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log_fh:
            log_fh.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
            log_fh.flush()
            self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log_fh,
                                            stderr=subprocess.STDOUT, cwd=self.cwd, start_new_session=True)
        return self

    def exit_code(self) -> int | None:
        """None while it runs (or before it started)."""
        return self.process.poll() if self.process is not None else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def listening(self) -> bool:
        """Whether it accepts TCP connections on ``port`` (True when no port is known)."""
        if self.port is None:
            return self.running()
        import socket

        try:
            with socket.create_connection((HOST, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self, grace: float = 10.0) -> str:
        """SIGTERM its process group, SIGKILL after ``grace`` s; returns what happened."""
        if self.process is None or self.process.poll() is not None:
            return "not running"
        outcome = "terminated"
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
            outcome = "killed"
        except ProcessLookupError:
            pass
        return outcome
