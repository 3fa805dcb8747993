"""The frontend as a subprocess on a loopback port: what the tests, the main job and the benchmark start beside
tritonserver. It gets a process group of its own so `stop` ends it (and only it) whatever it is doing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tritonserver_backend.launcher.net import HOST, free_port

ROOT = Path(__file__).resolve().parent.parent


class FrontendProcess:
    def __init__(self, triton_grpc_url: str, model_dir: Path, port: int | None = None, log_file: Path | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.triton_grpc_url, self.model_dir = triton_grpc_url, Path(model_dir)
        self.port = port or free_port()
        self.log_file = log_file
        self.extra_args = extra_args or []
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def start(self) -> "FrontendProcess":
        cmd = [sys.executable, "-m", "openai_frontend", "--triton-url", self.triton_grpc_url, "--host", HOST,
               "--port", str(self.port), "--model-dir", str(self.model_dir), *self.extra_args]
        out = open(self.log_file, "w") if self.log_file else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Seconds until `/health` answers 200 (tritonserver reachable and ready)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the OpenAI frontend exited with code {self.process.returncode}{self._log_hint()}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the OpenAI frontend was not ready after {timeout:.0f} s{self._log_hint()}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout)

    def _log_hint(self) -> str:
        if self.log_file and Path(self.log_file).exists():
            return "; log tail:\n" + "\n".join(Path(self.log_file).read_text().splitlines()[-20:])
        return ""

    def __enter__(self) -> "FrontendProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
