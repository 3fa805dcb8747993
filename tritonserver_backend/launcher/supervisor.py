"""A supervisor that owns one ``tritonserver`` and starts it again when a Python-backend stub or the server dies.

Why: Triton never restarts a dead Python-backend stub (SIGKILL, OOM, segfault; server issues 7862/8604). Its model is
gone for good, open decoupled streams hang forever, and ``/v2/health/ready`` stays 200. The hung requests cannot be
released any other way than by ending the server, so the policy is: notice the dead process within a poll (its exit
is read from /proc, no timeout involved), mark not ready, kill the whole server after a short grace (clients' open
streams end with UNAVAILABLE / a closed connection then), clean its shared-memory regions (``TritonServer.stop``),
start it again with the same arguments and ports, wait for ready, and be ready again. A restart policy
(:mod:`.restart_policy`) backs off and gives up when faults keep coming.

In explicit model-control mode the supervisor follows the operator's loads and unloads (Triton's repository API):
the stubs of a model loaded later are watched once Triton's repository index says the model is READY (not the stub
that only completes a config while the model loads, which ends by itself); a watched stub that ends while the index
says its model is UNLOADING, UNAVAILABLE ("unloaded") or gone, or that a new stub of the same instance replaced (a
load of a loaded model reloads it), ended on purpose and is no longer watched, instead of costing a restart. A stub
that ends while its model is still READY died, as in ``none`` mode. A restart loads the models that were READY at the
last look (every :data:`REFRESH_S`), so a heal neither brings back an unloaded model nor loses one loaded later.

States: ``starting`` → ``ready`` ⇄ ``healing`` → ``gave_up`` | ``stopped``; ``failed`` when the first start fails.
The status (:meth:`Supervisor.status`) is served by :mod:`.health_probe` (in full to loopback and operator-key
requests only) and written atomically to ``state_file`` on every change, so the CLI (``scripts/tritonserver.py
status``) can read it without a request. It keeps the last :data:`MAX_FAULTS_KEPT` faults and counts them all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tritonserver_backend.auth.admin_auth import AdminKeyError, KeyCheck
from tritonserver_backend.launcher.companion import Companion
from tritonserver_backend.launcher.errors import TritonServerError
from tritonserver_backend.launcher.health_probe import HealthProbe
from tritonserver_backend.launcher.net import HOST, http_ready, repository_index
from tritonserver_backend.launcher.process import proc_argv, proc_info, same_process, stub_instance_name
from tritonserver_backend.launcher.record import StubSeen
from tritonserver_backend.launcher.restart_policy import RestartPolicy
from tritonserver_backend.launcher.server import TritonServer

log = logging.getLogger(__name__)

STARTING, READY, HEALING, GAVE_UP, STOPPED, FAILED = "starting", "ready", "healing", "gave_up", "stopped", "failed"
FINAL_STATES = (GAVE_UP, STOPPED, FAILED)
STUB_EXITED, SERVER_EXITED, START_FAILED = "stub exited", "server exited", "start failed"
COMPANION_EXITED = "frontend exited"
REFRESH_S = 2.0  # how often the stub list is re-read (a /proc scan); a death is checked on every poll
MAX_FAULTS_KEPT = 64  # a server that faults for weeks must not grow the status (and every probe's answer) for ever
MODEL_READY = "READY"  # Triton's repository index state of a loaded model


def model_of(stub: StubSeen) -> str:
    """The model a stub serves: ``StubSeen.model`` is the stub's first argument, ``<repo>/<model>/<version>/model.py``;
    anything else is returned as it is."""
    text = stub.model or "?"
    path = Path(text)
    if path.suffix == ".py" and path.parent.name.isdigit() and path.parent.parent.name:
        return path.parent.parent.name
    return text


def _version_of(stub: StubSeen) -> str | None:
    """The version folder of a stub's ``<repo>/<model>/<version>/model.py``, or None."""
    parent = Path(stub.model or "").parent
    return parent.name if parent.name.isdigit() else None


def model_state(index: list[dict[str, Any]], stub: StubSeen) -> tuple[str | None, str | None]:
    """The state and reason Triton's repository index gives the model (and version) ``stub`` serves: READY when any
    matching entry is, else the first match's; (None, None) when the index does not name the model or names it without
    a state (never loaded)."""
    model, version = model_of(stub), _version_of(stub)
    entries = [e for e in index if e.get("name") == model and (version is None or e.get("version") in (None, version))]
    for entry in entries:
        if entry.get("state") == MODEL_READY:
            return MODEL_READY, None
    return (entries[0].get("state"), entries[0].get("reason")) if entries else (None, None)


@dataclasses.dataclass
class Fault:
    """One death the supervisor noticed, and how long healing took."""

    model: str  # the stub's model, or "tritonserver"
    pid: int | None
    kind: str  # STUB_EXITED, SERVER_EXITED, START_FAILED or COMPANION_EXITED
    detected_at: float  # wall-clock seconds since the epoch
    detail: str | None = None  # the server's exit code, or why a start failed
    healed_at: float | None = None
    heal_seconds: float | None = None

    def describe(self) -> str:
        what = f"{self.model} (PID {self.pid}) {self.kind}"
        return f"{what}: {self.detail}" if self.detail else what


class Supervisor:
    """Own one ``tritonserver``: start it, watch its stubs and itself, restart it after a death, serve health probes.

    ``factory`` makes a fresh (not started) :class:`TritonServer` for each start; ``start_kwargs`` are
    :meth:`TritonServer.start`'s keyword arguments. Ports left at None/0 are picked at the first start and fixed
    from then on, so a restart listens where clients already connect. ``bind_address="0.0.0.0"`` among them (a
    container) changes only what the server binds: the supervisor's own readiness checks stay on loopback, which
    reaches it.

    Use from tests::

        sup = Supervisor(lambda: TritonServer(work_dir=w), dict(model_repository=repo), state_file=w / "s.json")
        sup.start_thread(); sup.wait_state("ready", 120); ...; sup.stop()
    """

    def __init__(
        self,
        factory: Callable[[], TritonServer],
        start_kwargs: dict[str, Any],
        health_port: int | None = 0,
        health_host: str = HOST,
        policy: RestartPolicy | None = None,
        state_file: Path | str | None = None,
        ready_timeout: float = 120.0,
        heal_grace: float = 2.0,
        stop_grace: float | None = None,
        poll: float = 0.2,
        announce: Callable[[str], None] | None = None,
        companion: Callable[[dict[str, Any]], Companion] | None = None,
        operator_key_file: Path | str | None = None,
    ) -> None:
        self.factory = factory
        self.start_kwargs = dict(start_kwargs)
        self.policy = policy or RestartPolicy()
        self.state_file = Path(state_file) if state_file is not None else None
        self.ready_timeout = ready_timeout
        self.heal_grace = heal_grace  # its requests are hung: Triton's own exit timeout would only add delay
        self.stop_grace = stop_grace  # None: the server's exit timeout + 10 s, an orderly stop
        self.poll = poll
        self.announce = announce or (lambda line: None)
        self.companion_factory = companion  # makes the OpenAI frontend from the fixed start arguments (ports)
        self.companion: Companion | None = None
        self.server: TritonServer | None = None
        self.state = STARTING
        self.faults: list[Fault] = []  # the last MAX_FAULTS_KEPT
        self.faults_total = 0  # every fault since the start
        self.restarts = 0
        self.give_up_reason: str | None = None
        self.failure: str | None = None
        self.stop_outcome: str | None = None
        self.ready_after: float | None = None
        self.started_at = time.time()
        self._expected: list[StubSeen] = []  # the stubs watched: one that ends is a death (unless on purpose)
        self._instances: dict[tuple[int, int | None], str | None] = {}  # each watched stub's instance name
        self._next_refresh = 0.0
        self._stopping = threading.Event()
        self._changed = threading.Condition()
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self.exit_code: int | None = None
        # the adapter_admin key (docs/admin.md) unlocks the full /health for a remote operator; re-read on rotation
        self.operator_key_file = Path(operator_key_file) if operator_key_file is not None else None
        self._key_check = KeyCheck(self.operator_key_file) if self.operator_key_file is not None else None
        self._key_problem: str | None = None
        self.probe = HealthProbe(self.status, self._triton_ready, port=health_port or 0, host=health_host,
                                 operator_key=self._operator_key) if health_port is not None else None

    # -- status -------------------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What ``GET /health`` answers to loopback and operator-key requests, and the state file holds (the probe
        answers other peers with :func:`~.health_probe.public_status` of it)."""
        server = self.server
        info = proc_info(os.getpid())
        return {
            "state": self.state,
            "supervisor_pid": os.getpid(),
            "supervisor_start_ticks": info.start_ticks if info else None,
            "server_pid": server.pid if server is not None else None,
            "ports": {
                "http": self.start_kwargs.get("http_port"),
                "grpc": self.start_kwargs.get("grpc_port"),
                "metrics": self.start_kwargs.get("metrics_port"),
                "health": self.probe.port if self.probe is not None else None,
            },
            "host": HOST,  # where this supervisor and local clients reach the server, whatever it binds
            "bind_address": self.start_kwargs.get("bind_address", HOST),
            "companion": None if self.companion is None else {
                "name": self.companion.name, "pid": self.companion.pid, "port": self.companion.port,
                "running": self.companion.running(), "log_file": str(self.companion.log_file)},
            "health_url": f"{self.probe.url}/health" if self.probe is not None else None,
            "log_file": str(server.log_file) if server is not None and server.log_file else None,
            "pid_file": str(server.pid_file) if server is not None and server.pid_file else None,
            "cleaned": server.cleaned.summary() if server is not None and server.cleaned is not None else None,
            "ready_after": self.ready_after,
            "restarts": self.restarts,
            "faults": [dataclasses.asdict(f) for f in list(self.faults)],
            "faults_total": self.faults_total,
            "faults_kept": MAX_FAULTS_KEPT,
            "watching": [{"model": model_of(s), "instance": self._instances.get((s.pid, s.start_ticks)), "pid": s.pid}
                         for s in list(self._expected)],
            "operator_key_file": str(self.operator_key_file) if self.operator_key_file is not None else None,
            "give_up_reason": self.give_up_reason,
            "failure": self.failure,
            "stop_outcome": self.stop_outcome,
            "max_restarts": self.policy.max_restarts,
            "restart_window_s": self.policy.window_s,
            "started_at": self.started_at,
            "updated_at": time.time(),
        }

    def _set_state(self, state: str, why: str) -> None:
        with self._changed:
            self.state = state
            log.info("supervisor: %s (%s)", state, why)
            self._write_state()
            self._changed.notify_all()

    def _write_state(self) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_name(f".{self.state_file.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.status(), indent=2) + "\n")
        os.replace(tmp, self.state_file)

    def _operator_key(self) -> str | None:
        """The operator key now (None: no key file configured, or it is missing or unsafe; logged once per cause)."""
        if self._key_check is None:
            return None
        try:
            key = self._key_check.expected()
        except AdminKeyError as exc:
            if str(exc) != self._key_problem:
                self._key_problem = str(exc)
                log.warning("supervisor: no operator key for the full /health from remote peers: %s", exc)
            return None
        self._key_problem = None
        return key

    def _record_fault(self, fault: Fault) -> None:
        self.faults.append(fault)
        self.faults_total += 1
        del self.faults[:-MAX_FAULTS_KEPT]

    def _triton_ready(self) -> bool:
        """Triton answers ready now, and the frontend (when there is one) runs."""
        if self.companion_factory is not None and (self.companion is None or not self.companion.running()):
            return False
        port = self.start_kwargs.get("http_port")
        return bool(port) and http_ready(int(port), timeout=0.5)

    # -- test helpers -------------------------------------------------------------------------------------------------
    def start_thread(self) -> threading.Thread:
        """Run :meth:`run` in a daemon thread (tests; the CLI runs it in a thread too, so signals only set a flag)."""
        self._thread = threading.Thread(target=self._run_keep_code, name="supervisor", daemon=True)
        self._thread.start()
        return self._thread

    def _run_keep_code(self) -> None:
        self.exit_code = self.run()

    def wait_state(self, *states: str, timeout: float) -> str:
        """Wait until the state is one of ``states`` (or final); returns it. Raises TimeoutError naming the last."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.state not in states:
                left = deadline - time.monotonic()
                if left <= 0 or (self.state in FINAL_STATES and self.state not in states):
                    raise TimeoutError(f"supervisor state {self.state!r}, waited {timeout:g} s for {states}"
                                       + (f": {self.failure or self.give_up_reason}" if self.state in FINAL_STATES
                                          else ""))
                self._changed.wait(min(left, 0.5))
            return self.state

    def stop(self, join: float = 60.0) -> None:
        """Ask :meth:`run` to stop the server and return; a start in progress is cut short."""
        self._stopping.set()
        with self._lock:
            server = self.server
        if server is not None and self.state in (STARTING, HEALING):  # run() may be blocked in wait_ready
            server.stop(grace=self.heal_grace)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- the loop -----------------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Start the server and keep it serving until :meth:`stop`; 0 after a stop, 1 after a failed first start or a
        give-up."""
        if self.probe is not None:
            self.probe.start()
            log.info("supervisor: health probe on %s/health", self.probe.url)
        try:
            self._set_state(STARTING, "first start")
            error = self._start_server() or self._start_companion()
            if error is not None:
                self.failure = error
                self._set_state(FAILED, "the first start failed")
                return 1
            self._set_state(READY, f"tritonserver PID {self.server.pid if self.server else None} ready")
            while not self._stopping.wait(self.poll):
                fault = self._find_fault()
                if fault is not None and not self._heal(fault):
                    return 1 if self.state == GAVE_UP else 0
            return 0
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        if self.companion is not None:
            self.announce(f"stopping {self.companion.name} PID {self.companion.pid}: {self.companion.stop()}")
        with self._lock:
            server = self.server
        if server is not None:
            grace = self.heal_grace if self.state == GAVE_UP else self.stop_grace
            outcome = server.stop(grace=grace)
            if self.stop_outcome is None:
                self.stop_outcome = outcome
            self.announce(f"stopping tritonserver PID {server.pid}: {outcome}")
        if self.state not in FINAL_STATES:
            self._set_state(STOPPED, "stop requested")
        else:
            self._write_state()
        if self.probe is not None and self.state != GAVE_UP:
            self.probe.close()

    def close_probe(self) -> None:
        """Close the health probe (kept open after a give-up so the live probe can answer 503 until exit)."""
        if self.probe is not None:
            self.probe.close()

    def _start_server(self, healing: bool = False) -> str | None:
        """Start a fresh server and wait until ready (`healing`: in place of a dead one); returns None, or why it
        failed."""
        server = self.factory()
        server.healing = healing
        with self._lock:
            self.server = server
        if self._stopping.is_set():
            return "stopped"
        try:
            server.start(**self.start_kwargs)
            if server.cleaned is not None:  # the PID file named a server that died without a stop
                self.announce(f"cleaned up {server.cleaned.summary()}")
            self.announce(f"started PID {server.pid}; log {server.log_file}; PID file {server.pid_file}")
            for key, port in (("http_port", server.http_port), ("grpc_port", server.grpc_port),
                              ("metrics_port", server.metrics_port)):
                self.start_kwargs[key] = port  # fixed from now on: a restart listens where clients connect
            self._write_state()
            self.ready_after = server.wait_ready(self.ready_timeout)
        except (TritonServerError, ValueError, OSError) as exc:
            server.stop(grace=self.heal_grace)
            return f"{type(exc).__name__}: {exc}"
        record = server.snapshot()
        self._expected, self._instances = [], {}
        for stub in record.stubs if record is not None else []:
            self._watch(stub, stub_instance_name(proc_argv(stub.pid)))
        if self._explicit():
            self._look_at_index()  # what a restart must load again, from the first look on
        self._next_refresh = time.monotonic() + REFRESH_S
        log.info("supervisor: tritonserver PID %s ready after %.1f s with %d stub(s): %s", server.pid,
                 self.ready_after, len(self._expected),
                 ", ".join(f"{model_of(s)} (PID {s.pid})" for s in self._expected) or "none")
        self.announce(f"ready after {self.ready_after:.1f} s: HTTP http://{server.http_url}  gRPC {server.grpc_url}  "
                      f"metrics {server.metrics_url}")
        return None

    def _start_companion(self) -> str | None:
        """Start the frontend (when configured) and wait until it listens; returns None, or why it failed."""
        if self.companion_factory is None:
            return None
        if self.companion is not None:
            self.companion.stop(grace=self.heal_grace)
        companion = self.companion = self.companion_factory(self.start_kwargs).start()
        self.announce(f"started {companion.name} PID {companion.pid}; log {companion.log_file}")
        deadline = time.monotonic() + self.ready_timeout
        while not companion.listening():
            code = companion.exit_code()
            if code is not None:
                return f"{companion.name} exited with code {code} before it listened; log {companion.log_file}"
            if time.monotonic() > deadline or self._stopping.wait(0.2):
                return f"{companion.name} not listening on port {companion.port} after {self.ready_timeout:.0f} s"
        log.info("supervisor: %s PID %s listening on port %s", companion.name, companion.pid, companion.port)
        return None

    def _find_fault(self) -> Fault | None:
        """A recorded stub that is no longer the same process, the server's exit (read from /proc and waitpid), or
        the frontend's exit."""
        server = self.server
        if server is None:
            return None
        if self.companion is not None and self.companion.exit_code() is not None:
            return Fault(self.companion.name, self.companion.pid, COMPANION_EXITED, time.time(),
                         detail=f"exit code {self.companion.exit_code()}")
        code = server.process.poll() if server.process is not None else None
        if code is not None:
            return Fault("tritonserver", server.pid, SERVER_EXITED, time.time(), detail=f"exit code {code}")
        for stub in list(self._expected):
            if not same_process(stub.pid, stub.start_ticks):
                why = self._ended_on_purpose(server, stub)
                if why is None:
                    return Fault(model_of(stub), stub.pid, STUB_EXITED, time.time())
                self._unwatch(stub, why)
        if time.monotonic() >= self._next_refresh:  # stubs of models loaded later (explicit mode) are watched too
            self._next_refresh = time.monotonic() + REFRESH_S
            self._watch_new_stubs(server)
        return None

    # -- explicit model control: following loads and unloads ----------------------------------------------------------
    def _explicit(self) -> bool:
        return self.start_kwargs.get("model_control_mode") == "explicit"

    def _watch(self, stub: StubSeen, instance: str | None) -> None:
        self._expected.append(stub)
        self._instances[(stub.pid, stub.start_ticks)] = instance

    def _unwatch(self, stub: StubSeen, why: str) -> None:
        self._expected = [s for s in self._expected if (s.pid, s.start_ticks) != (stub.pid, stub.start_ticks)]
        instance = self._instances.pop((stub.pid, stub.start_ticks), None)
        line = f"{model_of(stub)} stub {instance or '?'} (PID {stub.pid}) ended on purpose ({why}): no longer watched"
        log.info("supervisor: %s", line)
        self.announce(line)
        self._write_state()

    def _look_at_index(self) -> list[dict[str, Any]] | None:
        """Triton's repository index now (None when it does not answer: a dying server, so nothing is learnt). In
        explicit mode the models READY in it become what a restart loads (``load_models``)."""
        port = self.start_kwargs.get("http_port")
        index = repository_index(int(port)) if port else None
        if index is not None and self._explicit():
            self.start_kwargs["load_models"] = sorted({str(e["name"]) for e in index
                                                       if e.get("state") == MODEL_READY and e.get("name")})
        return index

    def _watch_new_stubs(self, server: TritonServer) -> None:
        """Watch the stubs the server started since the last look. In explicit mode only those of a model the index
        calls READY (a loading model's stubs are watched at a later look) and never a config-completing stub, whose
        instance name is the bare model name (it ends by itself once the config is complete)."""
        record = server.snapshot()
        known = {(s.pid, s.start_ticks) for s in self._expected}
        new = [s for s in (record.stubs if record is not None else [])
               if (s.pid, s.start_ticks) not in known and same_process(s.pid, s.start_ticks)]
        index = self._look_at_index() if self._explicit() else None
        for stub in new:
            instance = stub_instance_name(proc_argv(stub.pid))
            if self._explicit():
                if instance is not None and instance == model_of(stub):
                    continue
                if index is None or model_state(index, stub)[0] != MODEL_READY:
                    continue
            if not same_process(stub.pid, stub.start_ticks):  # it ended while its command line was read
                continue
            log.info("supervisor: now also watching %s (PID %s)", model_of(stub), stub.pid)
            self._watch(stub, instance)

    def _ended_on_purpose(self, server: TritonServer, stub: StubSeen) -> str | None:
        """Why the ended ``stub`` is not a death, or None when it is. Only explicit mode can end a stub on purpose:
        a new stub of the same model and instance name replaced it (the model was loaded again), or Triton's index
        says its model is no longer READY (UNLOADING, UNAVAILABLE "unloaded", failed to load again, or gone from the
        repository). A server that does not answer the index proves nothing: the end is a death."""
        if not self._explicit() or model_of(stub) == (stub.model or "?"):
            return None
        key = (stub.pid, stub.start_ticks)
        instance = self._instances.get(key)
        record = server.snapshot()
        if instance is not None and record is not None:
            for live in record.stubs:
                if (live.pid, live.start_ticks) != key and live.model == stub.model \
                        and same_process(live.pid, live.start_ticks) \
                        and stub_instance_name(proc_argv(live.pid)) == instance:
                    return f"replaced by PID {live.pid}: {model_of(stub)} was loaded again"
        index = self._look_at_index()
        if index is None:
            return None
        state, reason = model_state(index, stub)
        if state == MODEL_READY:
            return None
        return f"{model_of(stub)} is {state or 'not loaded'}" + (f": {reason}" if reason else "")

    def _heal(self, fault: Fault) -> bool:
        """Restart after ``fault`` (and after failed restarts) until ready; False when stopping or giving up."""
        while True:
            detected = time.monotonic()
            with self._changed:  # one change: no reader sees the fault while the state still says ready
                self._record_fault(fault)
                self._set_state(HEALING, f"fault: {fault.describe()}")
            decision = self.policy.on_fault(detected)
            if not decision.restart:
                self._give_up(decision.reason or "too many faults")
                return False
            with self._lock:
                server = self.server
            if fault.kind == COMPANION_EXITED:  # Triton is fine: only the frontend starts again
                server = None
            if server is not None:
                outcome = server.stop(grace=self.heal_grace)
                cleaned = server.stop_cleanup.summary() if server.stop_cleanup is not None else "nothing recorded"
                log.info("supervisor: stopped tritonserver PID %s (%s); clean-up %s", server.pid, outcome, cleaned)
            if decision.delay > 0:
                log.info("supervisor: fault %d in the window; restarting in %.0f s", decision.count, decision.delay)
                if self._stopping.wait(decision.delay):
                    return False
            if self._stopping.is_set():
                return False
            self.restarts += 1
            log.info("supervisor: restart %d (same arguments and ports)", self.restarts)
            if fault.kind == COMPANION_EXITED:
                error = self._start_companion()
            else:
                error = self._start_server(healing=True)
                if error is None and self.companion_factory is not None and \
                        (self.companion is None or not self.companion.running()):
                    error = self._start_companion()
            if self._stopping.is_set():
                return False
            if error is None:
                fault.healed_at = time.time()
                fault.heal_seconds = round(time.monotonic() - detected, 3)
                self._set_state(READY, f"healed {fault.describe()} after {fault.heal_seconds:.1f} s")
                return True
            log.error("supervisor: restart %d failed: %s", self.restarts, error)
            if fault.kind == COMPANION_EXITED and self.companion is not None:
                fault = Fault(self.companion.name, self.companion.pid, COMPANION_EXITED, time.time(),
                              detail=error.splitlines()[0][:300])
            else:
                fault = Fault("tritonserver", self.server.pid if self.server else None, START_FAILED, time.time(),
                              detail=error.splitlines()[0][:300])

    def _give_up(self, reason: str) -> None:
        last = "; ".join(f.describe() for f in self.faults[-self.policy.max_restarts - 1:])
        self.give_up_reason = f"gave up: {reason}; last faults: {last}"
        log.error("supervisor: %s", self.give_up_reason)
        if self.companion is not None:
            self.companion.stop(grace=self.heal_grace)
        with self._lock:
            server = self.server
        if server is not None:
            self.stop_outcome = server.stop(grace=self.heal_grace)
        self._set_state(GAVE_UP, reason)
