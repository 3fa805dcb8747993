"""A loopback deployment: N encoder workers, M decoder workers and Dynamo's OpenAI frontend as processes, discovery
in files under the run folder (no etcd, no NATS); started and stopped as one.

The frontend runs with session affinity (`x-dynamo-session-id` binds a conversation to one encoder worker for
`affinity_ttl_s` idle seconds) on the KV router without engine events. The workers' shared secret (the internal key
that signs their calls to each other, session_guard.py) is created here, 0600, in the run folder before any worker
starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dynamo_deploy.tokenizer_files import write_model_folder
from dynamo_deploy.worker_common import MODEL_NAME, discovery_env
from tritonserver_backend.adapters.registry_init import ensure_registry
from tritonserver_backend.auth.session_auth import INTERNAL_KEY_FILE, InternalKey
from tritonserver_backend.core.drafting import DRAFT_BATCH
from tritonserver_backend.launcher.start_log import note_start

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DYNAMO_PYTHON = PROJECT_ROOT / ".venv-dynamo" / "bin" / "python"


@dataclass
class Deployment:
    run_dir: Path
    model_dir: Path
    engine_dir: Path
    encoders: int = 1
    decoders: int = 1
    http_port: int = 18080
    backend: str = "onnx"
    max_context: int = 2048
    affinity_ttl_s: int = 3600
    nixl_threshold_bytes: int = 0  # hand-overs from this size move through NIXL (0: NIXL off, all inline; transfer.py)
    record_logprobs: bool = False  # turns.jsonl keeps each token's log-probability (tests compare them bit for bit)
    session_auth: bool = True  # session tokens (session_guard.py); off only for a trusted single-tenant deployment
    tensor_parallel_size: int = 1  # each worker leads a group of this many ranks (torch backend; docs/parallel.md)
    expert_parallel: bool = False
    # the decoder workers' drafting (docs/speculative.md): auto = DSpark where the engines hold a drafter
    speculative: str = "auto"
    speculative_block: int = 5
    speculative_confidence: float = 0.0
    speculative_batch: int = DRAFT_BATCH
    python: Path = field(default_factory=lambda: Path(os.environ.get("MOL2_DYNAMO_PYTHON", DYNAMO_PYTHON)))
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, **discovery_env(self.run_dir), "PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1"}

    # ------------------------------------------------------------------ start
    def start(self, timeout_s: float = 300.0) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        write_model_folder(self.model_dir, self.run_dir / "model", MODEL_NAME, self.max_context)
        ensure_registry(self.run_dir / "registry", self.model_dir)
        InternalKey.from_file(self.run_dir / INTERNAL_KEY_FILE)  # created once (0600); every worker reads the same file
        for i in range(self.encoders):
            self.start_worker("encoder", i)
        for i in range(self.decoders):
            self.start_worker("decoder", i)
        self.procs["frontend"] = self._spawn("frontend", [
            "-m", "dynamo.frontend", "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port), "--router-mode", "kv",
            "--no-router-kv-events", "--router-session-affinity-ttl-secs", str(self.affinity_ttl_s)])
        self.wait_ready(timeout_s)
        self._write_state()

    def start_worker(self, role: str, index: int) -> None:
        (self.run_dir / "workers" / f"{role}-{index}.ready").unlink(missing_ok=True)
        self.procs[f"{role}-{index}"] = self._spawn(f"{role}-{index}", [
            "-m", f"dynamo_deploy.{role}_worker", "--index", str(index), "--run-dir", str(self.run_dir),
            "--model-dir", str(self.model_dir), "--engine-dir", str(self.engine_dir),
            "--registry-root", str(self.run_dir / "registry"), "--backend", self.backend,
            "--max-context", str(self.max_context), "--nixl-threshold-bytes", str(self.nixl_threshold_bytes),
            *(["--record-logprobs"] if self.record_logprobs else []),
            *([] if self.session_auth else ["--no-session-auth"]),
            *(["--tensor-parallel-size", str(self.tensor_parallel_size)] if self.tensor_parallel_size > 1 else []),
            *(["--enable-expert-parallel"] if self.expert_parallel else []),
            *(["--speculative", self.speculative, "--speculative-block", str(self.speculative_block),
               "--speculative-confidence", repr(self.speculative_confidence),
               "--speculative-batch", str(self.speculative_batch)] if role == "decoder" else [])])

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        """Start one process. The frontend's start is the deployment's line in the start log (start_log.py): it
        starts last, once per deployment, so the log counts deployments whose processes run (not a start() whose
        spawning a test replaced, nor a worker restarted into a running deployment)."""
        log = open(self.run_dir / "logs" / f"{name}.log", "ab")
        proc = subprocess.Popen([str(self.python), *args], cwd=PROJECT_ROOT, env=self.env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        if name == "frontend":
            note_start("dynamo", f"{self.run_dir} ({self.encoders}x{self.decoders})")
        return proc

    def wait_ready(self, timeout_s: float) -> None:
        """Every worker listed in discovery, and the frontend serving the model."""
        deadline = time.monotonic() + timeout_s
        workers = [n for n in self.procs if n != "frontend"]
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"processes exited during start: {dead}; logs in {self.run_dir / 'logs'}")
            ready = [n for n in workers if (self.run_dir / "workers" / f"{n}.ready").exists()]
            if len(ready) == len(workers) and MODEL_NAME in self._models():
                return
            time.sleep(0.5)
        raise TimeoutError(f"deployment not ready after {timeout_s:.0f} s; logs in {self.run_dir / 'logs'}")

    def wait_worker(self, name: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not (self.run_dir / "workers" / f"{name}.ready").exists():
            if time.monotonic() > deadline or self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} did not become ready; see {self.run_dir / 'logs' / (name + '.log')}")
            time.sleep(0.2)

    def _models(self) -> list[str]:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                return [m["id"] for m in json.load(r).get("data", [])]
        except OSError:
            return []

    def _write_state(self) -> None:
        state = {"url": self.url, "pids": {n: p.pid for n, p in self.procs.items()}}
        (self.run_dir / "deployment.json").write_text(json.dumps(state, indent=1))

    # ------------------------------------------------------------------ inspect, fail, stop
    def kill(self, name: str) -> None:
        """SIGKILL one process (a crashed worker: no clean deregistration)."""
        p = self.procs.pop(name)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)

    def stats(self) -> dict[str, dict]:
        return read_stats(self.run_dir)

    def stop(self) -> None:
        for name in sorted(self.procs, key=lambda n: n != "frontend"):  # frontend first, then the workers
            stop_process(self.procs[name])
        self.procs.clear()
        (self.run_dir / "deployment.json").unlink(missing_ok=True)


def stop_process(p: subprocess.Popen, grace_s: float = 10.0) -> None:
    if p.poll() is not None:
        return
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def read_stats(run_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((run_dir / "workers").glob("*.json"))}


def counter_totals(workers: list[dict], counters: tuple[str, ...]) -> dict[str, float]:
    """Each counter summed over these workers' stats (read_stats values) and over its labels (adapters, paths)."""
    totals = dict.fromkeys(counters, 0.0)
    for w in workers:
        for key, v in w["counters"].items():
            if key.split("/")[0] in totals:
                totals[key.split("/")[0]] += v
    return totals


def read_turns(run_dir: Path) -> list[dict]:
    path = run_dir / "turns.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stop_recorded(run_dir: Path, grace_s: float = 10.0) -> list[str]:
    """Stop a deployment started by another process (its pids in deployment.json): frontend first, then the workers."""
    state_file = run_dir / "deployment.json"
    if not state_file.exists():
        return []
    pids: dict[str, int] = json.loads(state_file.read_text())["pids"]
    stopped = []
    for name in sorted(pids, key=lambda n: n != "frontend"):
        pid = pids[name]
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
        stopped.append(name)
    state_file.unlink()
    return stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a child of this process that exited but was not reaped yet counts as gone
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True
