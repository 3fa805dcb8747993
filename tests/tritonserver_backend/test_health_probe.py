"""tritonserver_backend.launcher.health_probe: who gets the full /health, and what clients can hold of the probe.

In a container the probe listens on every interface, so the pod network reaches it. These tests show, on real HTTP
servers on this machine's own addresses (no traffic leaves it), that a peer that is neither loopback nor holds the
operator key (the adapter_admin key) gets state only, that the key unlocks the rest and a wrong one is refused, that
/health/live and /health/ready answer everyone alike, and that idle, surplus and dripping connections cannot keep the
probe from answering: each connection has a read timeout and a deadline, and the threads serving them are capped.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.waiting import wait_until
from tritonserver_backend.auth.admin_auth import ADMIN_KEY_HEADER, rotate_admin_key
from tritonserver_backend.launcher.health_probe import (
    BUSY_RESPONSE,
    FULL,
    PUBLIC,
    REFUSED,
    HealthProbe,
    answer,
    peer_is_loopback,
    presented_keys,
    public_status,
    view_for,
)
from tritonserver_backend.launcher.server import TritonServer
from tritonserver_backend.launcher.supervise import build_parser, operator_key_file_for, supervisor_from_args
from tritonserver_backend.launcher.supervisor import STUB_EXITED, Fault, Supervisor

KEY = "k" * 20 + "-operator-key-for-tests"
PUBLIC_KEYS = {"state", "live", "ready", "restarts", "faults_total", "gave_up", "view", "full_status"}


def _full_status(tmp_path: Path) -> dict[str, Any]:
    """A real supervisor's status (never run) with a fault whose detail names a path, as a failed start's does."""
    sup = Supervisor(lambda: TritonServer(work_dir=tmp_path / "unused"), {"model_repository": tmp_path,
                     "http_port": 18000, "grpc_port": 18001, "metrics_port": 18002}, health_port=None,
                     state_file=tmp_path / "supervisor.json", operator_key_file=tmp_path / "admin.key")
    sup._record_fault(Fault("decoder", 4242, STUB_EXITED, 1.0, detail=f"see {tmp_path}/work/tritonserver.log"))
    sup.restarts = 1
    sup.state = "ready"
    return sup.status()


# --------------------------------------------------------------------------------------------------------------------
# the decision, without a network
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("peer", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("10.0.0.5", False), ("192.0.2.2", False), ("::ffff:10.0.0.5", False), ("fe80::1%eth0", False),
    ("2001:db8::1", False), ("0.0.0.0", False), ("localhost", False), ("", False),
])
def test_peer_is_loopback(peer: str, loopback: bool) -> None:
    assert peer_is_loopback(peer) is loopback


def _headers(*pairs: tuple[str, str]) -> Message:
    message = Message()
    for name, value in pairs:
        message[name] = value
    return message


def test_presented_keys_reads_the_admin_header_and_bearer_tokens() -> None:
    assert presented_keys(_headers()) == []
    assert presented_keys(_headers((ADMIN_KEY_HEADER, f" {KEY} "))) == [KEY]
    assert presented_keys(_headers(("Authorization", f"Bearer {KEY}"))) == [KEY]
    assert presented_keys(_headers(("authorization", f"bearer  {KEY}"))) == [KEY]  # names and scheme: any case
    assert presented_keys(_headers(("Authorization", "Basic dXNlcjpwdw=="))) == []
    assert presented_keys(_headers((ADMIN_KEY_HEADER.upper(), "a"), ("Authorization", "Bearer b"))) == ["a", "b"]


def test_view_for_loopback_key_and_wrong_key() -> None:
    asked: list[bool] = []

    def expected() -> str:
        asked.append(True)
        return KEY

    assert view_for("127.0.0.1", [], expected) == FULL
    assert view_for("::ffff:127.0.0.1", ["wrong"], expected) == FULL  # loopback needs no key, a wrong one is moot
    assert view_for("192.0.2.2", [], expected) == PUBLIC
    assert not asked  # the key file is read only when a remote request brings a key
    assert view_for("192.0.2.2", [KEY], expected) == FULL
    assert view_for("192.0.2.2", [KEY[:-1]], expected) == REFUSED
    assert view_for("192.0.2.2", [KEY, "wrong"], expected) == REFUSED  # every key presented must match
    assert view_for("192.0.2.2", [KEY], lambda: None) == REFUSED  # no key file: no key opens it
    assert view_for("192.0.2.2", [KEY], None) == REFUSED


def test_the_public_view_names_no_pid_path_port_or_log_line(tmp_path: Path) -> None:
    status = _full_status(tmp_path)
    assert status["server_pid"] is None and status["supervisor_pid"] and status["faults"]  # the full one has them
    code, public = answer("/health", status, lambda: True, full=False)
    assert code == 200 and set(public) == PUBLIC_KEYS
    assert {k: v for k, v in public.items() if k != "full_status"} == {
        "state": "ready", "live": True, "ready": True, "restarts": 1, "faults_total": 1, "gave_up": False,
        "view": PUBLIC}
    text = json.dumps(public)
    for secret in (str(status["supervisor_pid"]), "4242", "18000", "18001", str(tmp_path), "tritonserver.log",
                   "admin.key", "decoder"):
        assert secret not in text, secret
    assert answer("/health", status, lambda: True, full=True) == (200, status)
    # a give-up shows as a flag; the reason (which names models, PIDs and exit details) stays in the full view
    gave_up = {**status, "state": "gave_up", "give_up_reason": "gave up: 6 faults; last faults: decoder (PID 4242)"}
    assert public_status(gave_up, lambda: True) | {"full_status": ""} == {
        "state": "gave_up", "live": False, "ready": False, "restarts": 1, "faults_total": 1, "gave_up": True,
        "view": PUBLIC, "full_status": ""}


# --------------------------------------------------------------------------------------------------------------------
# real servers
# --------------------------------------------------------------------------------------------------------------------


def _own_non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback (bindable here, so traffic to it stays on this machine),
    from the kernel's table of local addresses, else ``ip -4 addr``; None when there is none."""
    candidates: list[str] = []
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
        candidates += [prev.split()[-1] for prev, line in zip(lines, lines[1:]) if "/32 host LOCAL" in line]
    except OSError:
        pass
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
        candidates += [word.split("/")[0] for line in out.splitlines() for word in line.split()[3:4]]
    except (OSError, subprocess.SubprocessError):
        pass
    candidates.append(socket.gethostbyname(socket.gethostname()))
    for address in dict.fromkeys(candidates):
        if peer_is_loopback(address):
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((address, 0))  # proves the address is this machine's
            return address
        except OSError:
            continue
    return None


OWN_ADDRESS = _own_non_loopback_ipv4()
needs_own_address = pytest.mark.skipif(OWN_ADDRESS is None, reason="this machine has no non-loopback IPv4 address to "
                                                                    "reach the probe from (only loopback interfaces)")


def _get(url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def everywhere(tmp_path: Path) -> Iterator[tuple[HealthProbe, dict[str, Any]]]:
    """A probe on every interface, as in the image, with the operator key in a 0600 file read through the
    supervisor's own key check."""
    status = _full_status(tmp_path)
    key_file = tmp_path / "admin.key"
    rotate_admin_key(key_file, KEY)
    sup = Supervisor(lambda: TritonServer(work_dir=tmp_path / "unused"), {"model_repository": tmp_path},
                     health_port=None, operator_key_file=key_file)
    probe = HealthProbe(lambda: status, lambda: True, host="0.0.0.0", operator_key=sup._operator_key).start()
    try:
        yield probe, status
    finally:
        probe.close()


@needs_own_address
def test_a_remote_peer_gets_state_only_unless_it_sends_the_operator_key(
        everywhere: tuple[HealthProbe, dict[str, Any]]) -> None:
    probe, status = everywhere
    local, remote = f"http://127.0.0.1:{probe.port}", f"http://{OWN_ADDRESS}:{probe.port}"
    assert _get(f"{local}/health") == (200, status)  # loopback: everything, as before

    code, public = _get(f"{remote}/health")  # the peer address is OWN_ADDRESS: not loopback
    assert code == 200 and set(public) == PUBLIC_KEYS and public["view"] == PUBLIC
    assert public["state"] == "ready" and public["restarts"] == 1 and public["faults_total"] == 1
    assert str(status["supervisor_pid"]) not in json.dumps(public) and "tritonserver.log" not in json.dumps(public)

    assert _get(f"{remote}/health", {ADMIN_KEY_HEADER: KEY}) == (200, status)
    assert _get(f"{remote}/health", {"Authorization": f"Bearer {KEY}"}) == (200, status)
    code, refused = _get(f"{remote}/health", {ADMIN_KEY_HEADER: KEY + "x"})
    assert code == 403 and set(refused) == {"error"} and KEY not in refused["error"]
    assert _get(f"{remote}/health?x=1", {"Authorization": "Bearer nope-nope-nope-nope"})[0] == 403

    # the probes answer everyone alike, key or not
    for headers in ({}, {ADMIN_KEY_HEADER: "wrong"}):
        assert _get(f"{remote}/health/live", headers) == (200, {"live": True, "state": "ready", "reason": None})
        assert _get(f"{remote}/health/ready", headers) == (200, {"ready": True, "state": "ready"})


@needs_own_address
def test_a_rotated_key_takes_effect_without_a_restart(tmp_path: Path,
                                                      everywhere: tuple[HealthProbe, dict[str, Any]]) -> None:
    probe, status = everywhere
    remote = f"http://{OWN_ADDRESS}:{probe.port}"
    new_key = "n" * 32
    rotate_admin_key(tmp_path / "admin.key", new_key)
    assert _get(f"{remote}/health", {ADMIN_KEY_HEADER: KEY})[0] == 403
    assert _get(f"{remote}/health", {ADMIN_KEY_HEADER: new_key}) == (200, status)
    (tmp_path / "admin.key").chmod(0o644)  # an unsafe key file unlocks nothing (and is logged)
    assert _get(f"{remote}/health", {ADMIN_KEY_HEADER: new_key})[0] == 403
    assert _get(f"{remote}/health")[1]["view"] == PUBLIC


def _handler_threads() -> int:
    return sum(1 for t in threading.enumerate() if "process_request_thread" in t.name)


def _open_idle(port: int, count: int) -> list[socket.socket]:
    """Connections that send nothing at all (slowloris' first move)."""
    return [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout bounds each read)."""
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_connections_over_the_cap_are_answered_busy_at_once() -> None:
    """Four slots held by clients that send nothing; a fifth connection is not queued behind them (their read timeout
    is 60 s here, beyond the request's own 10 s timeout) but answered 503 at once; once the slots are free, 200."""
    probe = HealthProbe(lambda: {"state": "ready"}, lambda: True, max_threads=4, read_timeout=60,
                        request_deadline=120).start()
    idle: list[socket.socket] = []
    try:
        idle = _open_idle(probe.port, 4)
        wait_until(lambda: _handler_threads() == 4, 10, "four handler threads to hold the idle connections")
        code, body = _get(f"{probe.url}/health/ready", timeout=10)
        assert code == 503 and "busy" in body["error"] and probe.httpd.refused == 1
        assert _handler_threads() == 4  # the cap held
        for sock in idle:
            sock.close()
        idle = []
        wait_until(lambda: _get(f"{probe.url}/health/ready")[0] == 200, 10, "/health/ready to answer 200 again")
    finally:
        for sock in idle:
            sock.close()
        probe.close()


def test_idle_connections_beyond_the_cap_cannot_keep_the_probe_from_answering() -> None:
    """More connections that send nothing than there are threads: the surplus is answered busy at once, the others are
    closed by the read timeout, never more than the cap are served at once, and /health/ready answers 200 again
    within a bound (a generous multiple of the 2 s read timeout) although not one idle client went away."""
    cap, read_timeout = 4, 2.0
    probe = HealthProbe(lambda: {"state": "ready"}, lambda: True, max_threads=cap, read_timeout=read_timeout,
                        request_deadline=60).start()
    idle: list[socket.socket] = []
    try:
        idle = _open_idle(probe.port, cap + 4)
        wait_until(lambda: probe.httpd.refused >= 4, 10, "the surplus connections to be answered busy")
        assert _handler_threads() <= cap
        code, _ = _get(f"{probe.url}/health/ready", timeout=10)  # answered (busy while the idle ones hold the slots)
        assert code in (200, 503)
        wait_until(lambda: _get(f"{probe.url}/health/ready")[0] == 200, 10 * read_timeout,
                   "/health/ready to answer 200 while the idle clients are still connected")
        answers = [_read_until_closed(sock) for sock in idle]  # each: closed by the server, busy or silent
        assert sorted(answers) == [b""] * cap + [BUSY_RESPONSE] * 4
    finally:
        for sock in idle:
            sock.close()
        probe.close()


def test_a_client_dripping_its_request_is_cut_at_the_deadline() -> None:
    """A byte every 0.2 s never trips the 1 s read timeout; the 2 s deadline ends the connection anyway (bound: 20 s,
    ten times the deadline)."""
    probe = HealthProbe(lambda: {"state": "ready"}, lambda: True, max_threads=2, read_timeout=1.0,
                        request_deadline=2.0).start()
    try:
        sock = socket.create_connection(("127.0.0.1", probe.port), timeout=5)
        sock.sendall(b"GET /health HTTP/1.0\r\n")
        started = time.monotonic()
        closed = False
        try:
            while time.monotonic() - started < 20:
                sock.sendall(b"X")
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            closed = True
        if not closed:
            sock.settimeout(0.5)
            try:
                closed = _read_until_closed(sock) == b""
            except TimeoutError:  # still open
                closed = False
        sock.close()
        assert closed, "the dripping connection was still open after 20 s"
        assert _get(f"{probe.url}/health/ready")[0] == 200
    finally:
        probe.close()


# --------------------------------------------------------------------------------------------------------------------
# where the supervisor finds the operator key
# --------------------------------------------------------------------------------------------------------------------


def _admin_config(repo: Path, **params: str) -> Path:
    (repo / "adapter_admin").mkdir(parents=True)
    text = "".join(f'parameters {{\n  key: "{k}"\n  value: {{ string_value: "{v}" }}\n}}\n' for k, v in params.items())
    (repo / "adapter_admin" / "config.pbtxt").write_text('name: "adapter_admin"\nbackend: "python"\n' + text)
    return repo


@pytest.mark.parametrize(("params", "expected"), [
    ({"registry_root": "artifacts/registry", "admin_key_file": ""}, "{root}/artifacts/registry/admin.key"),
    ({"registry_root": "/var/lib/mol2/registry", "admin_key_file": "/etc/mol2/admin/admin.key"},
     "/etc/mol2/admin/admin.key"),
    ({"registry_root": "/srv/reg"}, "/srv/reg/admin.key"),
    ({"registry_root": "reg", "admin_key_file": "keys/admin.key"}, "{root}/keys/admin.key"),
])
def test_the_operator_key_is_the_adapter_admin_key_of_the_repository(tmp_path: Path, params: dict[str, str],
                                                                      expected: str) -> None:
    repo = _admin_config(tmp_path / "model_repository", **params)
    assert operator_key_file_for(repo) == Path(expected.format(root=tmp_path))
    assert operator_key_file_for(tmp_path / "nowhere") is None  # no adapter_admin: no key, loopback only


def test_the_cli_passes_the_key_file_to_the_supervisor(tmp_path: Path) -> None:
    repo = _admin_config(tmp_path / "model_repository", registry_root="reg", admin_key_file="")
    common = ["--model-repository", str(repo), "--work-dir", str(tmp_path / "work"), "--health-port", "0"]
    derived = supervisor_from_args(build_parser().parse_args(common))
    given = supervisor_from_args(build_parser().parse_args([*common, "--operator-key-file", str(tmp_path / "k")]))
    try:
        assert derived.operator_key_file == tmp_path / "reg" / "admin.key"
        assert given.operator_key_file == tmp_path / "k" and given.status()["operator_key_file"] == str(tmp_path / "k")
    finally:
        derived.close_probe()
        given.close_probe()


def test_the_detached_supervisor_gets_the_clis_operator_key_file(tmp_path: Path) -> None:
    """`scripts/tritonserver.py start --operator-key-file F` spawns the supervisor with F (absolute); without the flag
    the supervisor derives the file itself, so nothing is passed."""
    from tests.deploy.checks import launcher_cli

    cli = launcher_cli()
    base = ["start", "--model-repository", str(tmp_path)]
    for extra, expected in (([], None), (["--operator-key-file", "keys/op.key"], str(Path("keys/op.key").resolve()))):
        argv = cli._supervise_argv(cli.build_parser().parse_args([*base, *extra]), tmp_path / "tritonserver.pid")
        detached = build_parser().parse_args(argv[argv.index("tritonserver_backend.launcher.supervise") + 1:])
        assert detached.operator_key_file == expected
