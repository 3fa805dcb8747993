"""A tensor-parallel group led by the serving process: it starts the other ranks, broadcasts every call, and turns a
lost rank into a clear error instead of a hang.

The process that serves (a Triton model instance, or an in-process pipeline) is rank 0 and computes like the others,
in the manner of TensorRT-LLM's orchestrator mode: it spawns ranks 1..N-1 as `python -m
tritonserver_backend.engines.rank_worker`, joins them in a gloo process group, and for every call writes one line to
each worker's stdin (a worker idles on that line with no timeout: a server may wait hours for a request, and a
collective would time out) and then broadcasts the call's arguments. Each rank runs the call on its shard
(`shard_steps.py`); the step's own collectives meet inside it; every rank ends with the whole outputs, and the
leader returns its own.

A rank that dies: the leader sees it before a call (its exit status), as a broken pipe when it writes the call's
line, or as the collective failing (gloo reports a closed connection at once; a rank that hangs alive is bounded by
the group timeout). It then kills the remaining ranks and raises `RankLost` naming the rank and how it ended; the
session state lives in the leader's services, not in the ranks, so the next call starts a fresh group and carries
on (the last adapter bank is sent again). A worker whose leader goes away reads end-of-file on stdin and exits, and
one whose leader died exits within a second (it watches its parent), so no rank outlives its server.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tritonserver_backend.engines.interface import Arrays, EngineUnavailable
from tritonserver_backend.errors import ServingError

LOG = logging.getLogger(__name__)

#: How long a collective waits for a peer (seconds): bounds a call whose peer hangs without dying.
GROUP_TIMEOUT_S = 120.0
#: How long starting a group may take (spawn, join, load the shards).
START_TIMEOUT_S = 300.0
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class RankLost(EngineUnavailable, ServingError):
    """A rank of the group died or failed during a call; the group was stopped and restarts on the next call. A
    `ServingError`: the requests of that step get its message (which rank, how it ended), not a generic one."""


def worker_python() -> str:
    """The interpreter for the workers: this environment's. A Triton Python-backend stub embeds Python, so
    `sys.executable` may be the stub itself; its `sys.prefix` is the environment the stub runs model code with."""
    for candidate in (Path(sys.prefix) / "bin" / "python3", Path(sys.executable)):
        if candidate.name.startswith("python") and candidate.exists():
            return str(candidate)
    raise EngineUnavailable(f"no Python interpreter found for the tensor-parallel ranks under {sys.prefix}")


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class RankGroup:
    """Ranks 1..world-1 of one role as child processes, this process as rank 0 (`local` runs its share)."""

    def __init__(self, model_dir: Path, role: str, world: int, expert_parallel: bool, threads: int = 1,
                 group_timeout_s: float = GROUP_TIMEOUT_S, rank_files: Path | None = None) -> None:
        if world < 2:
            raise ValueError(f"a rank group needs at least 2 ranks, got {world}")
        self.model_dir, self.role, self.world = Path(model_dir), role, world
        self.expert_parallel, self.threads, self.group_timeout_s = expert_parallel, threads, group_timeout_s
        self.rank_files = rank_files  # a rank-local build, or None: each rank slices the checkpoint
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.local: Any = None  # this process's ShardSteps
        self.group: Any = None  # the gloo group (`comm.open_group`)
        self.starts = 0  # how many times a group was started (restarts included)
        self._bank: Arrays | None = None
        self._bank_sent = False
        # one call at a time: the ranks must see the calls in one order (the services call from one engine thread;
        # this also holds if a bank arrives from another thread mid-step)
        self._lock = threading.RLock()

    @property
    def running(self) -> bool:
        return self.local is not None

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------------ start / stop
    def start(self) -> None:
        from ced.parallel.comm import Comm, barrier, open_group
        from ced.ports import free_port
        from tritonserver_backend.engines.shard_steps import ShardSteps

        port = free_port()
        log_dir = Path(tempfile.mkdtemp(prefix=f"mol2-{self.role}-ranks-"))
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "OMP_NUM_THREADS": str(self.threads)}
        python = worker_python()
        self.procs, self.logs = [], []
        for rank in range(1, self.world):
            log = log_dir / f"rank{rank}.log"
            command = [python, "-m", "tritonserver_backend.engines.rank_worker", "--model-dir", str(self.model_dir),
                       "--role", self.role, "--rank", str(rank), "--world", str(self.world), "--port", str(port),
                       "--threads", str(self.threads), "--timeout-s", str(self.group_timeout_s),
                       "--leader-pid", str(os.getpid())] + (["--expert-parallel"] if self.expert_parallel else []) \
                + (["--rank-files", str(self.rank_files)] if self.rank_files else [])
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                                   env=env, cwd=str(PROJECT_ROOT)))
            self.logs.append(log)
        self.starts += 1
        LOG.info("%s: started tensor-parallel ranks 1..%d (pids %s, logs in %s)", self.role, self.world - 1,
                 self.worker_pids(), log_dir)
        failure: list[BaseException] = []
        # filled by the joiner, taken only once it succeeded (an abandoned one changes nothing)
        made: dict[str, Any] = {}

        def join_and_load() -> None:
            try:
                made["group"] = open_group(port, 0, self.world, self.group_timeout_s)
                made["local"] = ShardSteps(self.model_dir, self.role, Comm(made["group"]), self.expert_parallel,
                                           self.rank_files)
                barrier(made["group"])  # every rank has loaded its shard
            except BaseException as error:  # noqa: BLE001 - reported to the caller below
                failure.append(error)

        joiner = threading.Thread(target=join_and_load, name=f"{self.role}-rank-group-start", daemon=True)
        joiner.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while joiner.is_alive():
            joiner.join(0.1)
            dead = self._dead()
            if dead is not None or time.monotonic() > deadline:
                self._fail(dead or f"the {self.role} ranks did not start within {START_TIMEOUT_S:g} s")
        if failure:
            self._fail(self._dead_soon() or f"starting the group failed: {failure[0]}")
        self.group, self.local = made["group"], made["local"]
        self._bank_sent = False
        LOG.info("%s: tensor-parallel group of %d ranks ready (this rank holds %.1f MB)", self.role, self.world,
                 self.local.held_bytes / 1e6)

    def stop(self) -> None:
        """Kill the workers and drop the process group (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        self.procs, self.local, self.group = [], None, None

    # ------------------------------------------------------------------ calls
    def set_bank(self, bank: Arrays) -> None:
        """Remembered and sent with the next step (and again after a restart)."""
        with self._lock:
            self._bank, self._bank_sent = bank, False

    def step(self, feed: Arrays) -> Arrays:
        with self._lock:
            if not self.running:
                self.start()
            if self._bank is not None and not self._bank_sent:
                self._call("bank", self._bank)
                self._bank_sent = True
            return self._call("step", feed)

    def _call(self, op: str, payload: Any) -> Any:
        from ced.parallel.comm import broadcast_object

        dead = self._dead()
        if dead is not None:
            self._fail(dead)
        try:
            for p in self.procs:
                assert p.stdin is not None
                p.stdin.write(b"call\n")
                p.stdin.flush()
            broadcast_object(self.group, (op, payload))
            if op == "bank":
                self.local.set_bank(payload)
                return None
            return self.local.step(payload)
        except Exception as error:  # noqa: BLE001 - whatever broke the call, the ranks are no longer in step
            self._fail(self._dead_soon() or f"the call failed on rank 0: {type(error).__name__}: {error}")
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ failures
    def _dead(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                tail = self._log_tail(rank)
                return (f"rank {rank} of {self.world} {_describe_exit(code)}"
                        + (f"; its last output: {tail}" if tail else ""))
        return None

    def _dead_soon(self, within_s: float = 5.0) -> str | None:
        """`_dead()`, waiting a little: a rank's closed connection reaches us before its exit status does (a crashing
        rank still prints its traceback and tears down torch), and the dead rank is the reason worth reporting."""
        deadline = time.monotonic() + within_s
        while True:
            dead = self._dead()
            if dead is not None or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def _log_tail(self, rank: int) -> str:
        try:
            lines = self.logs[rank - 1].read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-3:])

    def _fail(self, reason: str) -> None:
        self.stop()
        message = (f"the tensor-parallel {self.role} group lost a rank: {reason}. The group was stopped; the next "
                   "request starts it again (sessions are kept: their state lives in the serving process)")
        LOG.error(message)
        raise RankLost(message)
