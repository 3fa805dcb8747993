"""tritonserver_backend.launcher.supervisor: restart a tritonserver whose Python-backend stub (or itself) died.

Fast tests: the restart policy's back-off, give-up and quiet-period reset, the health probe's answers in each
state, the bound on the faults kept, and how Triton's repository index decides whether an ended stub died. Slow tests
(a real tritonserver on the tiny repository of test_launcher: `add_one` and the decoupled `stream_n`, two stubs):
SIGKILL a stub and watch the supervisor notice, heal and serve again leaving no region of the killed server behind;
kill it again and again and watch it give up; in explicit mode, load, load again and unload models through Triton's
repository API without a restart, then heal a killed stub of a model that is still loaded. (The probe's access rules
and connection limits: test_health_probe.py.)
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.tritonserver_backend.test_launcher import (
    READY_TIMEOUT,
    _kill_quietly,
    _need_server,
    _serves_add_one,
    _stubs_of,
    _write_model,
    make_model_repository,
)
from tests.waiting import holds_for, wait_until
from tritonserver_backend.launcher import (
    TritonServer,
    free_port,
    group_members,
    mapped_shm_regions,
    pid_alive,
    stop_pid,
)
from tritonserver_backend.launcher.companion import Companion
from tritonserver_backend.launcher.health_probe import HealthProbe, answer
from tritonserver_backend.launcher.process import SHM_DIR, SHM_REGION_NAME, stub_instance_name
from tritonserver_backend.launcher.record import StubSeen
from tritonserver_backend.launcher.restart_policy import RestartPolicy
from tritonserver_backend.launcher.start_log import START_LOG_ENV
from tritonserver_backend.launcher.supervise import openai_frontend
from tritonserver_backend.launcher.supervisor import (
    COMPANION_EXITED,
    GAVE_UP,
    HEALING,
    MAX_FAULTS_KEPT,
    READY,
    REFRESH_S,
    STUB_EXITED,
    Fault,
    Supervisor,
    model_of,
    model_state,
)

ROOT = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------------------------------------------------
# fast unit tests
# --------------------------------------------------------------------------------------------------------------------


def test_policy_backs_off_then_gives_up_within_the_window() -> None:
    policy = RestartPolicy(max_restarts=5, window_s=600, delays=(0, 2, 5, 10, 20))
    decisions = [policy.on_fault(now=100.0 + i) for i in range(6)]
    assert [d.delay for d in decisions[:5]] == [0, 2, 5, 10, 20]
    assert all(d.restart for d in decisions[:5])
    assert not decisions[5].restart and decisions[5].count == 6
    assert "6 faults within 600 s" in (decisions[5].reason or "")


def test_policy_repeats_the_last_delay_and_forgets_old_faults() -> None:
    policy = RestartPolicy(max_restarts=10, window_s=60, delays=(0, 3))
    assert [policy.on_fault(now=t).delay for t in (0.0, 1.0, 2.0, 3.0)] == [0, 3, 3, 3]
    # a fault after a quiet period longer than the window starts the count and the back-off afresh
    fresh = policy.on_fault(now=3.0 + 61)
    assert fresh.restart and fresh.count == 1 and fresh.delay == 0


def test_policy_counts_only_faults_inside_the_window() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=10, delays=(0,))
    assert policy.on_fault(now=0.0).restart and policy.on_fault(now=5.0).restart
    assert policy.on_fault(now=11.0).restart  # the fault at 0 s left the window: 2 in it
    assert not policy.on_fault(now=12.0).restart  # 5, 11, 12: three within 10 s
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)


@pytest.mark.parametrize(
    ("state", "triton", "live", "ready"),
    [("starting", True, 200, 503), ("ready", True, 200, 200), ("ready", False, 200, 503),
     ("healing", True, 200, 503), ("gave_up", False, 503, 503), ("stopped", False, 200, 503)],
)
def test_probe_answers_for_each_state(state: str, triton: bool, live: int, ready: int) -> None:
    status = {"state": state, "faults": [], "give_up_reason": "gave up: x" if state == "gave_up" else None}
    asked: list[bool] = []

    def triton_ready() -> bool:
        asked.append(True)
        return triton

    assert answer("/health/live", status, triton_ready)[0] == live
    code, body = answer("/health/ready", status, triton_ready)
    assert code == ready and body["ready"] is (ready == 200)
    assert bool(asked) is (state == "ready")  # Triton is asked only when the supervisor itself is ready
    assert answer("/health", status, triton_ready, full=True) == (200, status)
    code, public = answer("/health", status, triton_ready)  # the default is the public view
    assert code == 200 and public["state"] == state and public["view"] == "public"
    assert public["live"] is (live == 200) and public["ready"] is (ready == 200)
    assert public["gave_up"] is (state == "gave_up") and "give_up_reason" not in public
    assert answer("/nope", status, triton_ready)[0] == 404


def _get(url: str, timeout: float = 2.0) -> tuple[int, Any, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers.get("Content-Type", "")


def test_probe_serves_json_over_http() -> None:
    status = {"state": "healing", "faults": [{"model": "decoder"}]}
    probe = HealthProbe(lambda: status, lambda: True).start()  # on loopback: this test's requests get it all
    try:
        assert probe.port > 0
        assert _get(f"{probe.url}/health/ready")[:2] == (503, {"ready": False, "state": "healing"})
        code, body, ctype = _get(f"{probe.url}/health")
        assert code == 200 and body == status and ctype == "application/json"
        status["state"] = "ready"
        assert _get(f"{probe.url}/health/ready")[0] == 200
    finally:
        probe.close()


def test_model_of_reads_the_stub_argument() -> None:
    assert model_of(StubSeen(pid=1, start_ticks=1, model="/r/model_repository/decoder/1/model.py")) == "decoder"
    assert model_of(StubSeen(pid=1, start_ticks=1, model="odd")) == "odd"
    assert model_of(StubSeen(pid=1, start_ticks=1)) == "?"


def test_stub_instance_name_tells_an_instance_from_a_config_stub() -> None:
    """Argv words as /proc showed them for Triton 2.51's stubs (an instance, then the stub that completes a config)."""
    head = ["/w/backends/python/triton_python_backend_stub", "/r/add_one/1/model.py",
            "triton_python_backend_shm_region_23f9c35c", "1048576", "1048576", "4630", "/w/backends/python", "336"]
    assert stub_instance_name([*head, "add_one_0_0", "DEFAULT"]) == "add_one_0_0"
    assert stub_instance_name([*head, "add_one", "DEFAULT"]) == "add_one"
    assert stub_instance_name(["/usr/bin/python3", *head[1:], "add_one_0_0"]) is None  # not a stub
    assert stub_instance_name(head) is None  # too short: no name to read


# Triton 2.51's POST /v2/repository/index as seen from this machine: a model never loaded has no version or state
INDEX = [{"name": "add_one", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"},
         {"name": "stream_n", "version": "1", "state": "READY"}, {"name": "drip"},
         {"name": "enc", "version": "1", "state": "UNLOADING"}, {"name": "enc", "version": "2", "state": "READY"}]


@pytest.mark.parametrize(("model", "expected"), [
    ("/r/add_one/1/model.py", ("UNAVAILABLE", "unloaded")), ("/r/stream_n/1/model.py", ("READY", None)),
    ("/r/drip/1/model.py", (None, None)), ("/r/gone/1/model.py", (None, None)),
    ("/r/enc/1/model.py", ("UNLOADING", None)), ("/r/enc/2/model.py", ("READY", None)),
])
def test_model_state_reads_the_stubs_model_and_version(model: str, expected: tuple[str | None, str | None]) -> None:
    assert model_state(INDEX, StubSeen(pid=1, start_ticks=1, model=model)) == expected


def _bare_supervisor(tmp_path: Path, **kwargs: Any) -> Supervisor:
    """A supervisor that is never run (no server): for what it records and reports."""
    return Supervisor(lambda: TritonServer(work_dir=tmp_path / "unused"), {"model_repository": tmp_path},
                      health_port=None, **kwargs)


def test_the_faults_kept_are_bounded_and_all_are_counted(tmp_path: Path) -> None:
    sup = _bare_supervisor(tmp_path)
    for i in range(3 * MAX_FAULTS_KEPT + 5):
        sup._record_fault(Fault("decoder", 1000 + i, STUB_EXITED, float(i)))
    status = sup.status()
    assert sup.faults_total == status["faults_total"] == 3 * MAX_FAULTS_KEPT + 5
    assert len(sup.faults) == len(status["faults"]) == MAX_FAULTS_KEPT == status["faults_kept"]
    assert [f["pid"] for f in status["faults"]] == list(range(1000 + 2 * MAX_FAULTS_KEPT + 5, 1000 + 3 * MAX_FAULTS_KEPT
                                                                + 5))  # the newest, in order
    assert answer("/health", status, lambda: True)[1]["faults_total"] == 3 * MAX_FAULTS_KEPT + 5


# --------------------------------------------------------------------------------------------------------------------
# a real server (slow)
# --------------------------------------------------------------------------------------------------------------------


# a decoupled model that answers slowly: a stream is still open when its stub is killed
DRIP_CONFIG = """\
name: "drip"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

DRIP_MODEL = """\
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))]))
                time.sleep(0.2)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def _regions() -> set[Path]:
    return set(SHM_DIR.glob(f"{SHM_REGION_NAME}*"))


def _supervisor(tmp_path: Path, drip: bool = False, start: dict[str, Any] | None = None, **kwargs: Any) -> Supervisor:
    install = _need_server()
    work = tmp_path / "work"
    repo = make_model_repository(tmp_path)
    if drip:
        _write_model(repo, "drip", DRIP_CONFIG, DRIP_MODEL)
    return Supervisor(lambda: TritonServer(install, work_dir=work),
                      dict(model_repository=repo, exit_timeout=2, **(start or {})),
                      state_file=work / "supervisor.json", ready_timeout=READY_TIMEOUT, stop_grace=5.0, **kwargs)


def _open_drip_stream(grpc_url: str, events: queue.Queue) -> Any:
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: events.put((time.monotonic(), result, error)))
    inp = grpcclient.InferInput("N", [1], "INT32")
    inp.set_data_from_numpy(np.array([10_000], dtype=np.int32))
    client.async_stream_infer("drip", [inp], request_id="open")
    return client


@pytest.mark.slow
def test_a_killed_stub_is_noticed_and_healed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the start log (scripts/test.sh's accounting; a file of this test's own when none is set) tells the heal apart
    start_log = Path(os.environ.get(START_LOG_ENV) or tmp_path / "starts.log")
    monkeypatch.setenv(START_LOG_ENV, str(start_log))
    sup = _supervisor(tmp_path, drip=True)
    stubs: list[int] = []
    client = None
    try:
        sup.start_thread()
        sup.wait_state(READY, timeout=READY_TIMEOUT)
        assert sup.probe is not None
        health = f"{sup.probe.url}/health"
        assert _get(f"{health}/ready")[0] == 200 and _get(f"{health}/live")[0] == 200
        server = sup.server
        assert server is not None
        first_pid, ports = server.pid, (server.http_port, server.grpc_port, server.metrics_port)
        stubs = _stubs_of(first_pid)
        assert len(stubs) == 3
        drip_stub = next(p for p in stubs if "/drip/" in Path(f"/proc/{p}/cmdline").read_text())
        killed_regions = mapped_shm_regions([first_pid, *stubs])
        assert len(killed_regions) >= 3

        # a decoupled stream is open and answering when its stub dies: Triton alone would leave it hanging for ever
        events: queue.Queue = queue.Queue()
        client = _open_drip_stream(server.grpc_url, events)
        _, first, error = events.get(timeout=30)
        assert error is None and first is not None

        os.kill(drip_stub, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: _get(f"{health}/ready")[0] == 503, 5, "/health/ready to answer 503 after the kill")
        not_ready_after = time.monotonic() - killed_at
        assert _get(f"{health}/live")[0] == 200
        while True:  # responses sent before the kill may still arrive; then the stream must end with an error
            at, _, error = events.get(timeout=15)
            if error is not None:
                break
        stream_ended_after = at - killed_at
        # Triton may fail the request itself ("Stub process 'drip_0_0' is not healthy.") or the kill of the server
        # ends the stream (UNAVAILABLE / socket closed); either way the client is told, it does not wait for ever
        assert error is not None and str(error)
        sup.wait_state(READY, timeout=60)
        healed_after = time.monotonic() - killed_at
        print(f"not ready {not_ready_after:.2f} s after the kill, open stream ended after {stream_ended_after:.2f} s "
              f"({str(error).splitlines()[0][:120]}), healed after {healed_after:.2f} s")
        assert healed_after < 60

        new = sup.server
        assert new is not None and new.pid != first_pid
        assert (new.http_port, new.grpc_port, new.metrics_port) == ports  # same ports: clients reconnect there
        _serves_add_one(new)
        assert _get(f"{health}/ready")[0] == 200
        assert not pid_alive(first_pid) and group_members(first_pid) == []
        assert not (killed_regions & _regions()), "a region of the killed server was left in /dev/shm"

        code, body, _ = _get(health)
        assert code == 200 and body["state"] == READY and body["restarts"] == 1
        assert body["server_pid"] == new.pid and body["ports"]["http"] == ports[0]
        [fault] = body["faults"]
        assert fault["model"] == "drip" and fault["pid"] == drip_stub and fault["kind"] == STUB_EXITED
        assert fault["healed_at"] >= fault["detected_at"] and 0 < fault["heal_seconds"] < 60
        state = json.loads((tmp_path / "work" / "supervisor.json").read_text())
        assert state["faults"] == body["faults"] and state["supervisor_pid"] == os.getpid()
        logged = [line.split("\t")[1] for line in start_log.read_text().splitlines() if str(tmp_path) in line]
        assert logged == ["tritonserver-toy", "tritonserver-toy-heal"]
    finally:
        if client is not None:
            client.stop_stream()
            client.close()
        sup.stop()
        _kill_quietly(stubs)
    assert sup.exit_code == 0 and sup.server is not None and not sup.server.is_running()


@pytest.mark.slow
def test_repeated_faults_make_it_give_up(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, policy=RestartPolicy(max_restarts=2, window_s=120, delays=(0,)))
    try:
        sup.start_thread()
        for round_ in range(3):
            sup.wait_state(READY, timeout=60)
            assert sup.server is not None
            pid = sup.server.pid
            os.kill(pid, signal.SIGKILL) if round_ == 2 else os.kill(_stubs_of(pid)[0], signal.SIGKILL)
            sup.wait_state(HEALING, GAVE_UP, timeout=5)
        sup.wait_state(GAVE_UP, timeout=30)
        assert sup.probe is not None
        code, body, _ = _get(f"{sup.probe.url}/health/live")
        assert code == 503 and body["live"] is False
        assert "gave up: 3 faults within 120 s" in body["reason"] and "tritonserver" in body["reason"]
        assert _get(f"{sup.probe.url}/health/ready")[0] == 503
        assert sup.faults[-1].kind == "server exited" and sup.restarts == 2
        assert sup.server is not None and not sup.server.is_running() and group_members(sup.server.pid) == []
        sup._thread.join(30)  # type: ignore[union-attr]
        assert sup.exit_code == 1
    finally:
        sup.stop()
        sup.close_probe()


@pytest.mark.slow
def test_cli_supervised_start_status_fault_stop(tmp_path: Path) -> None:
    _need_server()
    repo = make_model_repository(tmp_path)
    work = tmp_path / "work"
    pid_file = tmp_path / "cli.pid"
    common = ["--work-dir", str(work), "--pid-file", str(pid_file)]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "tritonserver.py"), *args], capture_output=True,
                              text=True, timeout=READY_TIMEOUT + 30)

    sup_pid = None
    try:
        started = cli("start", *common, "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0",
                      "--metrics-port", "0", "--health-port", "0", "--exit-timeout", "2")
        assert started.returncode == 0, started.stdout + started.stderr
        assert "ready after" in started.stdout and "health http://127.0.0.1:" in started.stdout, started.stdout
        sup_pid = int((work / "supervisor.pid").read_text())
        pid = int(pid_file.read_text())
        assert pid_alive(sup_pid) and pid_alive(pid)
        status = cli("status", *common)
        assert status.returncode == 0 and "supervisor: ready" in status.stdout, status.stdout + status.stderr

        stub = _stubs_of(pid)[0]
        os.kill(stub, signal.SIGKILL)
        wait_until(lambda: json.loads((work / "supervisor.json").read_text())["restarts"] == 1
                   and json.loads((work / "supervisor.json").read_text())["state"] == READY, 60, "the heal")
        status = cli("status", *common)
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"(PID {stub}) stub exited" in status.stdout and "healed after" in status.stdout, status.stdout
        new_pid = int(pid_file.read_text())
        assert new_pid != pid

        stopped = cli("stop", *common)
        assert stopped.returncode == 0 and "terminated" in stopped.stdout, stopped.stdout + stopped.stderr
        assert not pid_alive(sup_pid) and not pid_alive(new_pid) and group_members(new_pid) == []
        assert not pid_file.exists()
    finally:
        if sup_pid is not None and pid_alive(sup_pid):
            os.kill(sup_pid, signal.SIGKILL)
        if pid_file.exists():
            stop_pid(int(pid_file.read_text()), grace=5)


@pytest.mark.slow
def test_the_openai_frontend_is_started_and_restarted_alone(tmp_path: Path) -> None:
    port = free_port()
    sup = _supervisor(tmp_path, companion=openai_frontend(port, tmp_path / "work" / "openai_frontend.log"))
    try:
        sup.start_thread()
        sup.wait_state(READY, timeout=READY_TIMEOUT)
        assert sup.probe is not None and sup.companion is not None and sup.server is not None
        health = f"{sup.probe.url}/health"
        assert _get(f"{health}/ready")[0] == 200
        assert _get(f"http://127.0.0.1:{port}/health")[0] == 200
        server_pid, frontend_pid = sup.server.pid, sup.companion.pid
        assert frontend_pid is not None
        os.kill(frontend_pid, signal.SIGKILL)
        wait_until(lambda: _get(f"{health}/ready")[0] == 503, 5, "/health/ready to answer 503 without the frontend")
        wait_until(lambda: sup.faults, 5, "the supervisor to notice the frontend's exit")
        sup.wait_state(READY, timeout=60)
        assert sup.companion.pid != frontend_pid and sup.server.pid == server_pid  # Triton was left alone
        assert _get(f"http://127.0.0.1:{port}/health")[0] == 200 and _get(f"{health}/ready")[0] == 200
        [fault] = sup.faults
        assert fault.model == "openai_frontend" and fault.kind == COMPANION_EXITED and fault.pid == frontend_pid
        assert _get(health)[1]["companion"]["running"] is True
    finally:
        sup.stop()
    assert sup.companion is not None and not sup.companion.running()


@pytest.mark.slow
def test_faults_stay_bounded_through_restarts_until_it_gives_up(tmp_path: Path) -> None:
    """A frontend that exits at once, restarted until the policy gives up: every failed restart is a fault, more than
    are kept; the status keeps the newest and counts all, and the give-up reason still names the last ones."""
    port = free_port()

    def flaky(start_kwargs: dict[str, Any]) -> Companion:
        return Companion("flaky", ["/bin/sh", "-c", "exit 3"], tmp_path / "flaky.log", port=port)

    restarts = MAX_FAULTS_KEPT + 6
    sup = _bare_supervisor(tmp_path, companion=flaky, heal_grace=1.0,
                           policy=RestartPolicy(max_restarts=restarts, window_s=3600, delays=(0,)))
    assert sup._heal(Fault("flaky", None, COMPANION_EXITED, time.time())) is False
    assert sup.state == GAVE_UP and sup.restarts == restarts
    assert sup.faults_total == restarts + 1 and len(sup.faults) == MAX_FAULTS_KEPT
    status = sup.status()
    assert status["faults_total"] == restarts + 1 and len(status["faults"]) == MAX_FAULTS_KEPT
    assert all(f["kind"] == COMPANION_EXITED and "exited with code 3" in f["detail"] for f in status["faults"][1:])
    assert f"gave up: {restarts + 1} faults within 3600 s" in (sup.give_up_reason or "")


def _http_client(server: TritonServer) -> Any:
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(server.http_url, network_timeout=120.0)


def _watched(sup: Supervisor, model: str) -> list[int]:
    return [w["pid"] for w in sup.status()["watching"] if w["model"] == model]


def _watched_instead(sup: Supervisor, model: str, old: int) -> list[int]:
    """The stubs of ``model`` watched now, once ``old`` is no longer among them (else [])."""
    pids = _watched(sup, model)
    return [] if old in pids else pids


@pytest.mark.slow
def test_explicit_loads_reloads_and_unloads_are_followed_without_a_restart(tmp_path: Path) -> None:
    """Explicit mode: a model loaded through Triton's repository API is watched once READY; loading a loaded model
    again (Triton replaces its stub) and unloading it end stubs on purpose, which cost no restart; a killed stub of a
    model that is still loaded is healed, and the restarted server has the models that were loaded, not the
    unloaded one."""
    sup = _supervisor(tmp_path, start=dict(model_control_mode="explicit", load_models=["add_one"]))
    stubs: list[int] = []
    try:
        sup.start_thread()
        sup.wait_state(READY, timeout=READY_TIMEOUT)
        server = sup.server
        assert server is not None
        first_pid = server.pid
        [add_one] = wait_until(lambda: _watched(sup, "add_one"), 5, "add_one's stub to be watched")
        client = _http_client(server)
        try:
            client.load_model("stream_n")  # returns once it is loaded
            [stream_n] = wait_until(lambda: _watched(sup, "stream_n"), 15, "the stub of stream_n to be watched")
            stubs = _stubs_of(first_pid)

            client.load_model("add_one")  # loaded again: Triton starts a new stub, then ends the old one
            wait_until(lambda: not pid_alive(add_one), 30, "the replaced add_one stub to end")
            [again] = wait_until(lambda: _watched_instead(sup, "add_one", add_one), 15,
                                 "the old add_one stub unwatched, the new one watched")
            assert again != add_one
            assert sup.restarts == 0 and sup.faults_total == 0 and sup.server.pid == first_pid, sup.status()["faults"]

            client.unload_model("add_one")
            wait_until(lambda: not pid_alive(again), 30, "add_one's stub to end after the unload")
            wait_until(lambda: not _watched(sup, "add_one"), 5, "add_one to be no longer watched")
            holds_for(lambda: sup.state == READY and sup.restarts == 0 and sup.faults_total == 0
                      and sup.server is not None and sup.server.pid == first_pid, 2 * REFRESH_S + 1,
                      "no restart, no fault after a reload and an unload")
            assert client.is_model_ready("stream_n") and not client.is_model_ready("add_one")
        finally:
            client.close()
        assert sup.start_kwargs["load_models"] == ["stream_n"]  # what a restart loads now

        os.kill(stream_n, signal.SIGKILL)  # a model still loaded: a death, as in mode none
        sup.wait_state(HEALING, timeout=5)
        sup.wait_state(READY, timeout=60)
        assert sup.restarts == 1 and sup.server is not None and sup.server.pid != first_pid
        [fault] = sup.faults
        assert fault.model == "stream_n" and fault.pid == stream_n and fault.kind == STUB_EXITED
        client = _http_client(sup.server)
        try:  # the restarted server followed the load of stream_n and the unload of add_one
            assert client.is_model_ready("stream_n") and not client.is_model_ready("add_one")
        finally:
            client.close()
    finally:
        sup.stop()
        _kill_quietly(stubs)
    assert sup.exit_code == 0
