"""tritonserver_backend.launcher: finding the binary, preparing backends, and a real server over HTTP and gRPC.

The server tests (marked slow) build a tiny model repository in tmp_path: `add_one` (FP32 in, x + 1 out, plus the
stub's sys.prefix and numpy version, so a stub running the wrong Python or numpy 2's corruption both show) and the
decoupled `stream_n` (N responses, then the final flag). Every server started here is stopped by a finalizer.

Leaving nothing behind: a stopped stub (SIGSTOP) stands for a wedged one, which never notices that its server died;
a stub SIGKILLed with its server stands for one that died without unlinking its /dev/shm region.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc  # noqa: F401 - the serve extra installs both: a broken install must fail, not skip
import tritonclient.http  # noqa: F401

from tests.tiny import PROJECT_ROOT
from tests.waiting import wait_until
from tritonserver_backend.launcher import (
    HOST,
    TritonInstall,
    TritonNotFoundError,
    TritonServer,
    TritonServerError,
    check_numpy,
    error_lines,
    find_tritonserver,
    free_port,
    group_members,
    http_ready,
    mapped_shm_regions,
    pid_alive,
    prepare_backend_dir,
    server_env,
    stop_pid,
    tail,
)
from tritonserver_backend.launcher.install import STUB_NAME
from tritonserver_backend.launcher.logs import logged_shm_regions
from tritonserver_backend.launcher.net import repository_index
from tritonserver_backend.launcher.process import SHM_DIR, SHM_REGION_NAME, proc_info, regions_in_use
from tritonserver_backend.launcher.record import (
    ServerRecord,
    StubSeen,
    clean_up_after,
    read_record,
    record_path,
    write_record,
)

ROOT = PROJECT_ROOT
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
READY_TIMEOUT = 120.0

# --------------------------------------------------------------------------------------------------------------------
# model repository built by the tests
# --------------------------------------------------------------------------------------------------------------------

ADD_ONE_CONFIG = """\
name: "add_one"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "PYTHON_PREFIX" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "NUMPY_VERSION" data_type: TYPE_STRING dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

ADD_ONE_MODEL = """\
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", (x + np.float32(1)).astype(np.float32)),
                pb_utils.Tensor("PYTHON_PREFIX", np.array([sys.prefix.encode()], dtype=np.object_)),
                pb_utils.Tensor("NUMPY_VERSION", np.array([np.__version__.encode()], dtype=np.object_)),
            ]))
        return responses
"""

STREAM_CONFIG = """\
name: "stream_n"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

STREAM_MODEL = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i * i], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

BROKEN_MESSAGE = "deliberately broken model for test_launcher"
BROKEN_MODEL = f"""\
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("{BROKEN_MESSAGE}")

    def execute(self, requests):
        return []
"""


def _write_model(repo: Path, name: str, config: str, model_py: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(model_py)


def make_model_repository(root: Path, broken: bool = False) -> Path:
    repo = root / "model_repository"
    _write_model(repo, "add_one", ADD_ONE_CONFIG, ADD_ONE_MODEL)
    _write_model(repo, "stream_n", STREAM_CONFIG, STREAM_MODEL)
    if broken:
        _write_model(repo, "broken", ADD_ONE_CONFIG.replace('"add_one"', '"broken"'), BROKEN_MODEL)
    return repo


def _need_server() -> TritonInstall:
    """The server binary: the serve extra installs one (nvidia-pytriton's wheel), so a missing server is a broken
    install, and fails the test instead of skipping it."""
    try:
        return find_tritonserver()
    except TritonNotFoundError as exc:
        pytest.fail(f"tritonserver not found although the serve extra installs it (pip install -e '.[serve]'): {exc}")


# --------------------------------------------------------------------------------------------------------------------
# fast unit tests
# --------------------------------------------------------------------------------------------------------------------


def test_free_port_is_bindable_on_loopback() -> None:
    ports = {free_port() for _ in range(5)}
    for port in ports:
        assert 1024 <= port <= 65535
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, port))


def test_find_tritonserver_error_names_what_was_searched(tmp_path: Path) -> None:
    empty_bin, no_wheel = tmp_path / "empty-bin", tmp_path / "no-wheel" / "tritonserver"
    empty_bin.mkdir()
    with pytest.raises(TritonNotFoundError) as info:
        find_tritonserver(search_path=str(empty_bin), wheel_dir=no_wheel)
    message = str(info.value)
    assert str(empty_bin) in message
    assert str(no_wheel / "bin" / "tritonserver") in message
    assert "nvidia-pytriton" in message
    with pytest.raises(TritonNotFoundError, match="on PATH"):
        find_tritonserver("system", search_path="")
    with pytest.raises(ValueError):
        find_tritonserver("somewhere")


def test_find_tritonserver_prefers_system_binary_on_path(tmp_path: Path) -> None:
    prefix = tmp_path / "opt" / "tritonserver"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "backends" / "python").mkdir(parents=True)
    binary = prefix / "bin" / "tritonserver"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    install = find_tritonserver(search_path=str(prefix / "bin"), wheel_dir=tmp_path / "no-wheel")
    assert install.source == "system" and not install.is_wheel
    assert install.binary == binary.resolve()
    assert install.backend_dir == prefix / "backends"
    assert prepare_backend_dir(install, tmp_path / "work") == prefix / "backends"  # used as is, nothing copied
    assert not (tmp_path / "work").exists()
    env = server_env(install, base={"PATH": "/usr/bin"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert "LD_LIBRARY_PATH" not in env


def _fake_wheel(root: Path) -> TritonInstall:
    wheel = root / "site-packages" / "pytriton" / "tritonserver"
    (wheel / "bin").mkdir(parents=True)
    (wheel / "bin" / "tritonserver").write_text("#!/bin/sh\n")
    (wheel / "bin" / "tritonserver").chmod(0o755)
    (wheel / "backends" / "python" / "__pycache__").mkdir(parents=True)
    (wheel / "backends" / "python" / "libtriton_python.so").write_bytes(b"\x7fELF backend")
    (wheel / "backends" / "python" / "triton_python_backend_utils.py").write_text("# utils\n")
    (wheel / "backends" / "python" / "__pycache__" / "x.pyc").write_bytes(b"pyc")
    for version in ("3.10", PY_VERSION):
        stub = wheel / "python_backend_stubs" / version / STUB_NAME
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_bytes(f"stub for {version}".encode())
        stub.chmod(0o755)
    (root / "site-packages" / "nvidia_pytriton.libs").mkdir()
    install = find_tritonserver("wheel", wheel_dir=wheel)
    assert install.is_wheel and install.libs_dir == root / "site-packages" / "nvidia_pytriton.libs"
    return install


def test_prepare_backend_dir_is_idempotent(tmp_path: Path) -> None:
    install = _fake_wheel(tmp_path)
    work = tmp_path / "work"
    target = prepare_backend_dir(install, work)
    assert target == work / "backends"
    stub = target / "python" / STUB_NAME
    assert stub.read_bytes() == f"stub for {PY_VERSION}".encode()
    assert os.access(stub, os.X_OK)
    assert (target / "python" / "libtriton_python.so").read_bytes() == b"\x7fELF backend"
    assert not (target / "python" / "__pycache__").exists()
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in target.rglob("*") if p.is_file()}

    assert prepare_backend_dir(install, work) == target  # second call: nothing rewritten
    after = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in target.rglob("*") if p.is_file()}
    assert after == before

    # a changed source file (an upgraded wheel) is copied again; the rest stays untouched
    utils = install.backend_dir / "python" / "triton_python_backend_utils.py"
    utils.write_text("# utils, new version\n")
    prepare_backend_dir(install, work)
    assert (target / "python" / "triton_python_backend_utils.py").read_text() == "# utils, new version\n"
    assert stub.stat().st_ino == before[stub][0]

    with pytest.raises(TritonNotFoundError, match=r"no Python-backend stub for Python 3\.99.*3\.10"):
        prepare_backend_dir(install, tmp_path / "other", python_version="3.99")


def test_server_env_for_the_wheel(tmp_path: Path) -> None:
    install = _fake_wheel(tmp_path)
    env = server_env(install, base={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/x"})
    path = env["PATH"].split(os.pathsep)
    assert path[0] == str(Path(sys.executable).parent) and path[1:] == ["/usr/bin", "/bin"]
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert str(install.libs_dir) in libs and libs[-1] == "/opt/x"


def test_log_helpers_read_only_this_runs_part(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("E1129 09:00:00.1 1 old.cc:1] an error of an earlier run\nold line\n")
    offset = log.stat().st_size
    with open(log, "a") as fh:
        fh.write("I1129 info\n| broken | 1 | UNAVAILABLE: Internal: boom |\n"
                 + "".join(f"line {i}\n" for i in range(50)))
    assert error_lines(log, offset=offset) == ["| broken | 1 | UNAVAILABLE: Internal: boom |"]
    assert len(error_lines(log)) == 2
    assert tail(log, 3, offset) == "line 47\nline 48\nline 49\n"
    assert tail(log, 100, offset).startswith("I1129 info")
    assert tail(tmp_path / "missing.log") == "" and error_lines(tmp_path / "missing.log") == []


def test_numpy_is_below_2_for_the_python_backend() -> None:
    version = check_numpy()
    assert version is not None and version.startswith("1."), version


def test_build_command_is_loopback_only(tmp_path: Path) -> None:
    install = _fake_wheel(tmp_path)
    server = TritonServer(install, work_dir=tmp_path / "work")
    server.http_port, server.grpc_port, server.metrics_port = 18000, 18001, 18002
    cmd = server.build_command(tmp_path, tmp_path / "b", ["--log-verbose=1"], "explicit", ["a", "b"])
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}={HOST}" in cmd
    assert "--model-control-mode=explicit" in cmd and cmd.count("--load-model=a") == 1
    assert cmd[-1] == "--log-verbose=1"
    with pytest.raises(ValueError, match="explicit"):
        server.build_command(tmp_path, tmp_path / "b", load_models=["a"])
    with pytest.raises(ValueError):
        server.build_command(tmp_path, tmp_path / "b", model_control_mode="poll")
    with pytest.raises(ValueError, match="127.0.0.1 only"):
        server.build_command(tmp_path, tmp_path / "b", ["--http-address=0.0.0.0"])
    assert server.stop() is None  # never started: nothing to do


def _spawn(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def test_stop_pid_terms_then_kills() -> None:
    polite = _spawn("import time; print('up', flush=True); time.sleep(60)")
    assert stop_pid(polite.pid, grace=10, popen=polite) == "terminated"
    assert polite.returncode == -signal.SIGTERM and not pid_alive(polite.pid)

    stubborn = _spawn("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                      "time.sleep(60)")
    started = time.monotonic()
    assert stop_pid(stubborn.pid, grace=0.5, popen=stubborn) == "killed"
    assert time.monotonic() - started < 10
    assert stubborn.returncode == -signal.SIGKILL
    assert stop_pid(stubborn.pid, popen=stubborn) == "not running"


def test_logged_shm_regions_reads_verbose_stub_start_lines(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    region = f"{SHM_REGION_NAME}_5778d28b-954e-4ce0-a843-22ccf3e698b6"
    log.write_text(f'I1130 1 stub_launcher.cc:385] "Starting Python backend stub:  exec /w/{STUB_NAME} '
                   f'/m/add_one/1/model.py {SHM_REGION_NAME}_old 1048576 1048576 7 /w 336 add_one DEFAULT"\n')
    offset = log.stat().st_size
    with open(log, "a") as fh:
        fh.write(f'I1130 2 stub_launcher.cc:385] "Starting Python backend stub:  exec /w/{STUB_NAME} '
                 f'/m/add_one/1/model.py {region} 1048576 1048576 8 /w 336 add_one_0_0 DEFAULT"\nI1130 other\n')
    assert logged_shm_regions(log, offset) == [region]
    assert len(logged_shm_regions(log)) == 2
    assert logged_shm_regions(tmp_path / "missing.log") == [] and logged_shm_regions(None) == []


def test_record_round_trip_and_bare_pid_file(tmp_path: Path) -> None:
    pid_file = tmp_path / "x.pid"
    assert read_record(pid_file) is None
    record = ServerRecord(pid=4242, pgid=4242, start_ticks=7, boot_id="b", started_at=1.5, log_file="/l",
                          log_offset=3, stubs=[StubSeen(4243, 8, f"{SHM_DIR}/{SHM_REGION_NAME}_a", "m.py")],
                          shm_regions=[f"{SHM_DIR}/{SHM_REGION_NAME}_a"], info={"http_port": 8000, "pid": 4242})
    write_record(pid_file, record)
    assert pid_file.read_text() == "4242\n"
    data = json.loads(record_path(pid_file).read_text())
    assert data["http_port"] == 8000 and data["stubs"][0]["pid"] == 4243  # flat: the ports sit next to the rest
    assert read_record(pid_file) == record
    pid_file.write_text("4244\n")  # a PID file that no longer matches its JSON: the PID file wins
    assert read_record(pid_file) == ServerRecord(pid=4244)


_HOLD_REGION = """\
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
region = mmap.mmap(fd, 4096)
os.close(fd)
print("up", flush=True)
time.sleep(120)
"""

_LEADER = """\
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "up"
print(child.pid, flush=True)
"""


def test_clean_up_after_touches_only_what_is_provably_ours(tmp_path: Path) -> None:
    """No tritonserver needed: plain Python processes mapping fake region files stand for the server and stubs."""
    tag = f"{SHM_REGION_NAME}_launcher-test-{uuid.uuid4()}"
    orphan, held, left = (SHM_DIR / f"{tag}-{name}" for name in ("orphan", "held", "left"))
    not_a_region = SHM_DIR / f"launcher-test-{uuid.uuid4()}"
    precious = tmp_path / f"{SHM_REGION_NAME}_precious"  # the right name, but not in /dev/shm
    orphan.write_bytes(b"x")
    for path in (not_a_region, precious):
        path.write_bytes(b"keep")
    procs: list[int] = []
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_REGION, str(held)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    procs.append(holder.pid)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        ticks = proc_info(holder.pid).start_ticks
        # a record whose PID (and group) now belong to another process, and which names a "stub" that is no stub
        record = ServerRecord(pid=holder.pid, pgid=holder.pid, start_ticks=ticks + 1,
                              stubs=[StubSeen(holder.pid, ticks, str(held))],
                              shm_regions=[str(orphan), str(held), str(not_a_region), str(precious)])
        assert not record.server_alive()
        done = clean_up_after(record)
        assert done.killed == [] and pid_alive(holder.pid)
        assert done.unlinked == [orphan] and done.in_use == [held] and holder.pid in done.not_ours
        assert held.exists() and not_a_region.exists() and precious.exists()

        # a dead leader's group: what it left behind is killed, then its region (no longer mapped) is unlinked
        leader = subprocess.Popen([sys.executable, "-c", _LEADER, _HOLD_REGION, str(left)], stdout=subprocess.PIPE,
                                  text=True, start_new_session=True)
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        procs.append(child)
        assert leader.wait(timeout=30) == 0
        assert pid_alive(child) and proc_info(child).pgid == leader.pid  # the child outlived its group's leader
        assert regions_in_use([left]) == {left}
        done = clean_up_after(ServerRecord(pid=leader.pid, pgid=leader.pid, shm_regions=[str(left)]))
        assert done.killed == [child] and done.unlinked == [left]
        assert not pid_alive(child) and not left.exists()
        assert pid_alive(holder.pid) and held.exists()  # still untouched
    finally:
        for pid in procs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        holder.wait()
        for path in (orphan, held, left, not_a_region):
            path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------------------------------
# a real server (slow)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> TritonServer:
    install = _need_server()
    root = tmp_path_factory.mktemp("triton")
    srv = TritonServer(install, work_dir=root / "work")
    request.addfinalizer(srv.stop)
    srv.start(make_model_repository(root))
    seconds = srv.wait_ready(READY_TIMEOUT)
    print(f"tritonserver ({install.source}) ready after {seconds:.2f} s")
    return srv


def _add_one_inputs(module, values: np.ndarray):  # noqa: ANN001, ANN202 - http and grpc share the call shape
    inp = module.InferInput("INPUT0", list(values.shape), "FP32")
    inp.set_data_from_numpy(values)
    return [inp], [module.InferRequestedOutput(n) for n in ("OUTPUT0", "PYTHON_PREFIX", "NUMPY_VERSION")]


def _check_add_one(result, values: np.ndarray) -> None:  # noqa: ANN001
    out = result.as_numpy("OUTPUT0")
    assert out.dtype == np.float32 and out.shape == values.shape
    np.testing.assert_array_equal(out, values + np.float32(1))
    # the stub ran model.py with this very environment (venv first on PATH) and numpy 1.x
    assert result.as_numpy("PYTHON_PREFIX")[0].decode() == sys.prefix
    assert result.as_numpy("NUMPY_VERSION")[0].decode().startswith("1.")


@pytest.mark.slow
def test_http_add_one(server: TritonServer, seed: int) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    try:
        assert client.is_server_ready() and client.is_model_ready("add_one") and client.is_model_ready("stream_n")
        for values in (np.array([1.5, 2.5, 3.5], dtype=np.float32),  # the numpy-2 stub reads [1.5, 1.5, 1.5]
                       np.random.default_rng(seed).standard_normal(4097).astype(np.float32)):
            inputs, outputs = _add_one_inputs(httpclient, values)
            _check_add_one(client.infer("add_one", inputs, outputs=outputs), values)
    finally:
        client.close()


@pytest.mark.slow
def test_grpc_add_one(server: TritonServer, seed: int) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert client.is_server_live() and client.is_model_ready("add_one")
        for values in (np.array([1.5, 2.5, 3.5], dtype=np.float32),
                       np.random.default_rng(seed + 1).standard_normal(4097).astype(np.float32)):
            inputs, outputs = _add_one_inputs(grpcclient, values)
            _check_add_one(client.infer("add_one", inputs, outputs=outputs), values)
    finally:
        client.close()


@pytest.mark.slow
def test_grpc_decoupled_stream_delivers_every_response(server: TritonServer) -> None:
    import tritonclient.grpc as grpcclient

    n = 25
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        inp = grpcclient.InferInput("N", [1], "INT32")
        inp.set_data_from_numpy(np.array([n], dtype=np.int32))
        client.async_stream_infer("stream_n", [inp], request_id="stream-1", enable_empty_final_response=True)
        values, final = [], False
        deadline = time.monotonic() + 60
        while not final:
            result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            assert error is None, error
            response = result.get_response()
            assert response.id == "stream-1"
            final = response.parameters["triton_final_response"].bool_param
            out = result.as_numpy("OUT")
            if out is not None:
                values.append(int(out[0]))
        client.stop_stream()
    finally:
        client.close()
    assert values == [i * i for i in range(n)]
    assert results.empty()


@pytest.mark.slow
def test_explicit_mode_loads_only_the_named_models(tmp_path: Path) -> None:
    import tritonclient.http as httpclient

    install = _need_server()
    with TritonServer(install, work_dir=tmp_path / "work") as srv:
        srv.start(make_model_repository(tmp_path), model_control_mode="explicit", load_models=["add_one"])
        srv.wait_ready(READY_TIMEOUT)
        client = httpclient.InferenceServerClient(srv.http_url)
        try:
            assert client.is_model_ready("add_one")
            assert not client.is_model_ready("stream_n")
            # what the supervisor reads to tell an unload from a death: a model never loaded has no state yet
            assert {"name": "stream_n"} in (repository_index(srv.http_port) or [])
            client.load_model("stream_n")
            assert client.is_model_ready("stream_n")
            client.unload_model("add_one")
            wait_until(lambda: {"name": "add_one", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
                       in (repository_index(srv.http_port) or []), 30, "add_one to read as unloaded")
            assert {"name": "stream_n", "version": "1", "state": "READY"} in (repository_index(srv.http_port) or [])
        finally:
            client.close()
    assert not pid_alive(srv.process.pid)


@pytest.mark.slow
def test_stop_ends_the_server_process(tmp_path: Path) -> None:
    install = _need_server()
    srv = TritonServer(install, work_dir=tmp_path / "work")
    try:
        srv.start(make_model_repository(tmp_path), pid_file=tmp_path / "server.pid")
        srv.wait_ready(READY_TIMEOUT)
        pid = srv.pid
        assert int((tmp_path / "server.pid").read_text()) == pid
        assert http_ready(srv.http_port)
        # the Python-backend stubs run in the server's process group, which stop() ends as a whole
        assert len(group_members(pid)) >= 3  # server + one stub per model
        regions = mapped_shm_regions(group_members(pid))
        assert regions and all(r.exists() for r in regions)
        # the record next to the PID file names the stubs and regions it saw by the time the server was ready
        stubs = _stubs_of(pid)
        record = json.loads((tmp_path / "server.pid.json").read_text())
        assert record["pid"] == pid and record["pgid"] == pid
        assert record["start_ticks"] == proc_info(pid).start_ticks
        assert record["http_port"] == srv.http_port and record["command"] == srv.command
        assert {s["pid"] for s in record["stubs"]} == set(stubs)
        assert set(record["shm_regions"]) == {str(r) for r in regions}
        started = time.monotonic()
        assert srv.stop() == "terminated"
        print(f"clean stop took {time.monotonic() - started:.2f} s")
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert group_members(pid) == []
        assert not any(pid_alive(stub) for stub in stubs)
        assert not any(r.exists() for r in regions)
        assert not (tmp_path / "server.pid").exists() and not (tmp_path / "server.pid.json").exists()
        assert not http_ready(srv.http_port)
        assert srv.stop() == "not running"  # safe to call twice
    finally:
        srv.stop()


def _stubs_of(pid: int) -> list[int]:
    return sorted(m for m in group_members(pid) if m != pid)


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    assert pids, "no PIDs to wait for: the caller's list of what must go is empty"
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout, f"PIDs {pids} to exit")


def _kill_quietly(pids: list[int]) -> None:
    """Test clean-up of the processes a test stopped or orphaned itself."""
    for pid in pids:
        if pid_alive(pid) and proc_info(pid) is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _serves_add_one(srv: TritonServer) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(srv.http_url)
    try:
        values = np.array([1.5, 2.5, 3.5], dtype=np.float32)
        inputs, outputs = _add_one_inputs(httpclient, values)
        _check_add_one(client.infer("add_one", inputs, outputs=outputs), values)
    finally:
        client.close()


@pytest.mark.slow
def test_stop_leaves_no_stub_and_no_shm_region_behind(tmp_path: Path) -> None:
    """A wedged stub outlives the server's own orderly exit; stop() kills it and unlinks what the group had."""
    install = _need_server()
    srv = TritonServer(install, work_dir=tmp_path / "work")
    stubs: list[int] = []
    try:
        srv.start(make_model_repository(tmp_path), exit_timeout=1)
        srv.wait_ready(READY_TIMEOUT)
        pid, stubs = srv.pid, _stubs_of(srv.pid)
        regions = mapped_shm_regions(stubs)
        assert len(stubs) == 2 and len(regions) == 2
        os.kill(stubs[0], signal.SIGSTOP)
        assert srv.stop(grace=10) == "terminated"  # the server itself exits after its 1 s exit timeout
        assert group_members(pid) == [] and not any(pid_alive(stub) for stub in stubs)
        assert not any(r.exists() for r in regions) and regions_in_use(regions) == set()
        assert not srv.pid_file.exists() and not record_path(srv.pid_file).exists()
    finally:
        _kill_quietly(stubs)
        srv.stop(grace=5)


@pytest.mark.slow
def test_start_cleans_up_after_a_killed_server(tmp_path: Path, server: TritonServer) -> None:
    """SIGKILL the server only: a wedged stub lives on holding its region, a stub that died with the server left its
    region; the next start in the same work dir removes both, and then serves."""
    install = _need_server()
    repo, work = make_model_repository(tmp_path), tmp_path / "work"
    old = TritonServer(install, work_dir=work)
    stubs: list[int] = []
    try:
        old.start(repo)
        old.wait_ready(READY_TIMEOUT)
        old_pid, stubs = old.pid, _stubs_of(old.pid)
        regions = mapped_shm_regions(stubs)
        assert len(stubs) == 2 and len(regions) == 2
        wedged, died = stubs
        for stub in stubs:
            os.kill(stub, signal.SIGSTOP)  # stopped stubs cannot notice their server's death
        os.kill(old_pid, signal.SIGKILL)
        old.process.wait(timeout=10)
        os.kill(died, signal.SIGKILL)
        _wait_gone([died])
        assert pid_alive(wedged) and all(r.exists() for r in regions)  # what a crashed server leaves behind

        new = TritonServer(install, work_dir=work)
        try:
            new.start(repo)
            cleaned = new.cleaned
            assert cleaned is not None and cleaned.pid == old_pid, cleaned
            assert cleaned.killed == [wedged] and sorted(cleaned.unlinked) == sorted(regions), cleaned
            assert not pid_alive(wedged) and not any(r.exists() for r in regions)
            line = f"cleaned up after tritonserver PID {old_pid}: killed left-over PIDs {wedged}; unlinked 2 shm"
            assert line in new.log_file.read_text()
            assert read_record(new.pid_file).pid == new.pid  # the stale record is replaced by the new server's
            new.wait_ready(READY_TIMEOUT)
            _serves_add_one(new)
            assert http_ready(server.http_port)  # another server, in another work dir, was not disturbed
        finally:
            new.stop()
    finally:
        _kill_quietly(stubs)
        old.stop(grace=5)


@pytest.mark.slow
def test_clean_up_spares_another_running_server(tmp_path: Path, server: TritonServer) -> None:
    """Kill one of two servers, give its record the other's stubs and regions (as after PID reuse), restart it: the
    other server keeps its stubs and regions and still serves."""
    install = _need_server()
    other_stubs = _stubs_of(server.pid)
    other_regions = mapped_shm_regions(other_stubs)
    assert len(other_stubs) == 2 and len(other_regions) == 2
    repo, work = make_model_repository(tmp_path), tmp_path / "work"
    victim = TritonServer(install, work_dir=work)
    try:
        victim.start(repo)
        victim.wait_ready(READY_TIMEOUT)
        victim_pid, victim_stubs = victim.pid, _stubs_of(victim.pid)
        victim_regions = mapped_shm_regions(victim_stubs)
        # what the restart must remove is there now: else "gone" below would hold for empty lists
        assert len(victim_stubs) == 2 and len(victim_regions) == 2, (victim_stubs, victim_regions)
        os.kill(victim_pid, signal.SIGKILL)
        victim.process.wait(timeout=10)
        record = read_record(victim.pid_file)
        record.stubs += [StubSeen(pid, proc_info(pid).start_ticks - 1) for pid in other_stubs]  # reused PIDs
        record.shm_regions += [str(r) for r in other_regions]
        write_record(victim.pid_file, record)

        restarted = TritonServer(install, work_dir=work)
        try:
            restarted.start(repo)
            cleaned = restarted.cleaned
            assert cleaned is not None and not set(other_stubs) & set(cleaned.killed), cleaned
            assert set(other_stubs) <= set(cleaned.not_ours) and other_regions <= set(cleaned.in_use), cleaned
            assert all(pid_alive(p) for p in other_stubs) and _stubs_of(server.pid) == other_stubs
            assert all(r.exists() for r in other_regions)
            _wait_gone(victim_stubs)
            assert not any(r.exists() for r in victim_regions)
            restarted.wait_ready(READY_TIMEOUT)
            _serves_add_one(restarted)
            _serves_add_one(server)
        finally:
            restarted.stop()
    finally:
        victim.stop(grace=5)


@pytest.mark.slow
def test_broken_model_repository_fails_fast_with_the_log_tail(tmp_path: Path) -> None:
    install = _need_server()
    srv = TritonServer(install, work_dir=tmp_path / "work")
    try:
        srv.start(make_model_repository(tmp_path, broken=True))
        started = time.monotonic()
        with pytest.raises(TritonServerError) as info:
            srv.wait_ready(READY_TIMEOUT)
        assert time.monotonic() - started < READY_TIMEOUT / 2  # it noticed the exit, not the timeout
        message = str(info.value)
        # whichever it sees first: the failed model's log line, or the server exiting because of it
        assert "a model cannot start" in message or ("exited with code" in message and "before it was ready" in message)
        assert "last 40 lines of the server log" in message
        assert BROKEN_MESSAGE in message  # the model's own error reached the caller
        assert str(srv.log_file) in message
        assert not srv.is_running()
    finally:
        srv.stop()


@pytest.mark.slow
def test_wait_ready_times_out_and_stops_the_server(tmp_path: Path) -> None:
    install = _need_server()
    srv = TritonServer(install, work_dir=tmp_path / "work")
    try:
        # a model whose initialize() sleeps keeps the server not-ready past the short timeout
        repo = tmp_path / "slow_repo"
        _write_model(repo, "sleepy", ADD_ONE_CONFIG.replace('"add_one"', '"sleepy"'),
                     "import time\n\nclass TritonPythonModel:\n    def initialize(self, args):\n"
                     "        time.sleep(60)\n"
                     "\n    def execute(self, requests):\n        return []\n")
        srv.start(repo, exit_timeout=1)
        # the stub is up (and sleeping in initialize) once it maps its shared memory
        regions = wait_until(lambda: mapped_shm_regions(group_members(srv.pid)), 30, "the sleepy stub's shm region")
        members = group_members(srv.pid)
        assert srv.pid in members and len(members) >= 2, members  # the server and its stub: what must go below
        with pytest.raises(TritonServerError, match=r"not ready after 3 s[\s\S]*last 40 lines"):
            srv.wait_ready(3)
        assert not srv.is_running()
        assert group_members(srv.pid) == []  # the stub stuck in initialize() is gone too
        assert not any(r.exists() for r in regions)  # and so is the shared memory a killed stub would leak
    finally:
        srv.stop(grace=5)


@pytest.mark.slow
def test_cli_start_status_stop(tmp_path: Path) -> None:
    _need_server()
    repo = make_model_repository(tmp_path)
    pid_file = tmp_path / "cli.pid"
    script = [sys.executable, str(ROOT / "scripts" / "tritonserver.py")]
    common = ["--work-dir", str(tmp_path / "work"), "--pid-file", str(pid_file)]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(script + list(args), capture_output=True, text=True, timeout=READY_TIMEOUT + 30)

    stubs: list[int] = []
    try:
        started = cli("start", *common, "--no-supervise", "--model-repository", str(repo), "--http-port", "0",
                      "--grpc-port", "0", "--metrics-port", "0")
        assert started.returncode == 0, started.stdout + started.stderr
        assert "binary: " in started.stdout and "ready after" in started.stdout and "gRPC 127.0.0.1:" in started.stdout
        pid = int(pid_file.read_text())
        assert pid_alive(pid)

        status = cli("status", *common)
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"PID {pid}" in status.stdout and "ready: yes" in status.stdout

        again = cli("start", *common, "--model-repository", str(repo), "--http-port", "0")
        assert again.returncode == 2 and "already running" in again.stderr

        # the server dies behind the CLI's back, leaving a wedged stub and its region: the next start cleans up
        stubs = _stubs_of(pid)
        regions = mapped_shm_regions(stubs)
        recorded = json.loads(record_path(pid_file).read_text())
        assert len(stubs) == 2 and {s["pid"] for s in recorded["stubs"]} == set(stubs)
        assert len(regions) == 2 and all(r.exists() for r in regions), regions  # what the restart must remove
        os.kill(stubs[0], signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        _wait_gone([pid])
        status = cli("status", *common)
        assert status.returncode == 3 and "stale record" in status.stdout, status.stdout + status.stderr
        restarted = cli("start", *common, "--no-supervise", "--model-repository", str(repo), "--http-port", "0",
                        "--grpc-port", "0", "--metrics-port", "0")
        assert restarted.returncode == 0, restarted.stdout + restarted.stderr
        cleaned_line = f"cleaned up after tritonserver PID {pid}: killed left-over PIDs {stubs[0]}"
        assert cleaned_line in restarted.stdout and cleaned_line in (tmp_path / "work" / "tritonserver.log").read_text()
        assert not any(pid_alive(stub) for stub in stubs) and not any(r.exists() for r in regions)
        pid = int(pid_file.read_text())
        stubs = _stubs_of(pid)
        regions = mapped_shm_regions(stubs)
        assert pid_alive(pid) and len(stubs) == 2 and len(regions) == 2

        stopped = cli("stop", *common)
        assert stopped.returncode == 0 and "terminated" in stopped.stdout, stopped.stdout + stopped.stderr
        wait_until(lambda: not pid_alive(pid), 10, f"the stopped server (PID {pid}) to exit")
        assert not pid_file.exists()
        assert group_members(pid) == [] and not any(pid_alive(stub) for stub in stubs)  # stop left nothing behind
        assert not any(r.exists() for r in regions)

        status = cli("status", *common)
        assert status.returncode == 3 and "none" in status.stdout
    finally:
        _kill_quietly(stubs)
        if pid_file.exists():
            stop_pid(int(pid_file.read_text()), grace=5)


@pytest.mark.slow
def test_cli_foreground_stops_the_server_on_sigterm(tmp_path: Path) -> None:
    _need_server()
    pid_file = tmp_path / "fg.pid"
    cmd = [sys.executable, str(ROOT / "scripts" / "tritonserver.py"), "start", "--foreground",
           "--work-dir", str(tmp_path / "work"), "--pid-file", str(pid_file),
           "--model-repository", str(make_model_repository(tmp_path)),
           "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--health-port", "0"]
    cli = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server_pid = None
    try:
        assert cli.stdout is not None
        for line in cli.stdout:
            if line.startswith("ready after"):
                break
        else:
            pytest.fail(f"CLI ended before the server was ready (code {cli.wait()})")
        server_pid = int(pid_file.read_text())
        assert pid_alive(server_pid)
        cli.send_signal(signal.SIGTERM)
        rest = cli.communicate(timeout=60)[0]
        assert cli.returncode == 0, rest
        assert "terminated" in rest
        assert not pid_alive(server_pid)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        if server_pid is not None:
            stop_pid(server_pid, grace=5)


_ABORTING_ONCE = """#!{python}
# stands for a tritonserver whose Python backend aborts while models load the first time (a lock_exception), and
# that becomes ready the next time: it answers /v2/health/ready on its --http-port
import http.server, os, pathlib, sys
marker = pathlib.Path("aborted-once")
if {always} or not marker.exists():
    marker.write_text("x")
    print("terminate called after throwing an instance of 'boost::interprocess::lock_exception'", flush=True)
    print("  what():  boost::interprocess::lock_exception", flush=True)
    os.abort()
port = int(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--http-port=")))

class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
"""


@pytest.mark.parametrize("always", [False, True])
def test_a_lock_exception_abort_while_loading_is_started_once_more(tmp_path: Path, always: bool) -> None:
    """Triton 2.51's Python backend now and then aborts while models load (boost::interprocess::lock_exception, an
    upstream race; it crashed one start of a CI run on Dec 4). wait_ready starts such a run once more and returns when
    the second one gets ready; a second abort is an error with the log, and there is no third start."""
    install = _fake_wheel(tmp_path)
    install.binary.write_text(_ABORTING_ONCE.format(python=sys.executable, always=always))
    repo = tmp_path / "repo"
    repo.mkdir()
    server = TritonServer(install, work_dir=tmp_path / "work")
    server.start(repo)
    try:
        if always:
            with pytest.raises(TritonServerError, match="lock_exception"):
                server.wait_ready(30)
        else:
            server.wait_ready(30)
            assert server.is_running()
        assert server.lock_abort_restarts == 1
        assert server.log_file is not None and server.log_file.read_text().count("starting: ") == 2
    finally:
        server.stop()
    assert not server.is_running()
