"""Start, stop and probe a Triton Inference Server (loopback unless --address) for this project's model repository.

    .venv/bin/python scripts/tritonserver.py start --model-repository model_repository [--http-port 8000]
        [--grpc-port 8001] [--metrics-port 8002] [--pid-file F] [--log-file L] [--foreground] [--no-supervise]
        [--health-port 8003] [--health-address A] [--max-restarts 5] [--restart-window 600] [--address 0.0.0.0]
        [--no-engine-build] [-- EXTRA_ARGS...]
    .venv/bin/python scripts/tritonserver.py stop [--pid-file F]
    .venv/bin/python scripts/tritonserver.py status [--pid-file F] [--http-port P]

`start` is supervised by default (tritonserver_backend/launcher/supervisor.py): a supervisor process owns the server,
notices a dead Python-backend stub or a dead server within a second, kills and cleans up the server and starts it
again on the same ports (Triton itself never restarts a dead stub, and its /v2/health/ready stays 200). Its own
probes: http://127.0.0.1:8003/health/ready, /health/live, /health (JSON). It runs detached (PID in
WORK_DIR/supervisor.pid, log WORK_DIR/supervisor.log, state WORK_DIR/supervisor.json), or in this process with
--foreground. --no-supervise starts the bare server as before. In a container (deploy/docker/Dockerfile) it runs in
the foreground with --address 0.0.0.0 and --health-address 0.0.0.0, so the pod network reaches Triton and the probes.

The binary is a system `tritonserver` on PATH (an NGC container) or the one bundled in the `nvidia-pytriton` wheel.
Without --foreground, `start` returns once the server is ready and leaves it running (PID in the PID file). A port
of 0 means "pick a free one". Exit codes: 0 success (status: ready), 1 failure (status: running, not ready),
2 bad use or a PID file pointing at something that is not tritonserver, 3 (status/stop) not running.

`stop` leaves nothing behind: the server's process group (its Python-backend stubs) and the shared-memory regions
they had in /dev/shm go with it. When the PID file names a server that died without a stop (killed, crashed), `start`
and `stop` first clean up after it (left-over stubs, regions nobody uses) and say what they removed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tritonserver_backend.launcher import (
    HOST,
    TritonNotFoundError,
    TritonServer,
    TritonServerError,
    find_tritonserver,
    http_ready,
    is_tritonserver,
    pid_alive,
    stop_pid,
)
from tritonserver_backend.launcher.logs import tail
from tritonserver_backend.launcher.process import proc_argv, proc_info, same_process
from tritonserver_backend.launcher.record import clean_up_after, read_record, remove_record
from tritonserver_backend.launcher.supervise import (
    LOG_FILE_NAME,
    PID_FILE_NAME,
    STATE_FILE_NAME,
    add_address_argument,
    add_supervisor_arguments,
    run_until_signalled,
    supervisor_from_args,
)

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_WORK_DIR = ROOT / "build" / "tritonserver"


def _pid_file(args: argparse.Namespace) -> Path:
    return Path(args.pid_file) if args.pid_file else Path(args.work_dir) / "tritonserver.pid"


def _clean_up_stale(pid_file: Path) -> None:
    """Clean up after a dead server that the PID file names, say what was removed, and remove the PID file."""
    record = read_record(pid_file)
    if record is None or record.server_alive():
        return
    cleaned = clean_up_after(record)
    remove_record(pid_file, record.pid)
    print(f"cleaned up {cleaned.summary()}", flush=True)


def cmd_start(args: argparse.Namespace) -> int:
    pid_file = _pid_file(args)
    old = read_record(pid_file)
    if old is not None and old.server_alive():
        print(f"tritonserver already running with PID {old.pid} (PID file {pid_file}); stop it first",
              file=sys.stderr)
        return 2
    supervisor = live_supervisor(Path(args.work_dir))
    if supervisor is not None:
        print(f"a supervisor is already running with PID {supervisor} (work dir {args.work_dir}); stop it first",
              file=sys.stderr)
        return 2
    try:
        install = find_tritonserver(args.prefer)
    except TritonNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"binary: {install.describe()}", flush=True)
    if args.session_dir:  # the server's environment, and so the encoder's (glue.session_journal), inherits it
        os.environ["MOL2_SESSION_DIR"] = args.session_dir if args.session_dir == "off" else str(
            Path(args.session_dir).resolve())
    if not args.no_engine_build and ensure_engines(Path(args.model_repository)) != 0:
        return 1
    if not args.no_supervise:
        return _start_supervised(args, pid_file)
    server = TritonServer(install, work_dir=args.work_dir)
    extra = list(args.extra_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if args.foreground:  # before the server exists, so a SIGTERM at any point stops it instead of orphaning it
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        try:
            server.start(
                args.model_repository,
                http_port=args.http_port or None,
                grpc_port=args.grpc_port or None,
                metrics_port=args.metrics_port or None,
                log_file=args.log_file,
                extra_args=extra,
                model_control_mode=args.model_control_mode,
                load_models=args.load_model,
                pid_file=pid_file,
                exit_timeout=args.exit_timeout,
                bind_address=args.address,
            )
            if server.cleaned is not None:  # the PID file named a server that died without a stop
                print(f"cleaned up {server.cleaned.summary()}", flush=True)
            print(f"started PID {server.pid}; log {server.log_file}; PID file {pid_file}", flush=True)
            seconds = server.wait_ready(args.timeout)
        except (TritonServerError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            server.stop()
            return 1
        print(f"ready after {seconds:.1f} s: HTTP http://{server.http_url}  gRPC {server.grpc_url}  "
              f"metrics {server.metrics_url}", flush=True)
        if not args.foreground:
            server.detach()
            return 0
        code = server.process.wait() if server.process is not None else 0
        print(f"tritonserver exited with code {code}", file=sys.stderr)
        server.stop()
        return 0 if code == 0 else 1
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeated SIGTERM must not cut the stop short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"stopping tritonserver PID {server.pid}: {server.stop()}", flush=True)
        return 0 if args.foreground else 1


def ensure_engines(repository: Path) -> int:
    """Build (or reuse) the ONNX engines the repository's encoder model serves, as `scripts/main.sh` does: a model
    repository that names an engine directory should start without a separate build step."""
    import re

    config = repository / "encoder" / "config.pbtxt"
    if not config.exists():
        return 0
    params = dict(re.findall(r'key: "(\w+)"\s*value: \{ string_value: "([^"]*)" \}', config.read_text()))
    if params.get("engine_backend") != "onnx" or "engine_dir" not in params:
        return 0
    root = repository.resolve().parent  # paths in parameters are relative to the repository's parent
    model_dir, engine_dir = (Path(params[k]) if Path(params[k]).is_absolute() else root / params[k]
                             for k in ("model_dir", "engine_dir"))
    from build_engines.build.cli import main as build_engines

    print(f"engines: python -m build_engines build --model {model_dir} --out {engine_dir}", flush=True)
    return build_engines(["--model", str(model_dir), "--out", str(engine_dir)])


# -- supervised start ------------------------------------------------------------------------------------------------
def _state(work_dir: Path) -> dict | None:
    """The supervisor's state file (None when missing or half-written)."""
    try:
        data = json.loads((work_dir / STATE_FILE_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def live_supervisor(work_dir: Path) -> int | None:
    """The PID of the supervisor recorded in ``work_dir`` when that very process still runs (PID and start time from
    its state file, or a process whose command line is the supervisor's), else None."""
    try:
        pid = int((work_dir / PID_FILE_NAME).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if pid == os.getpid():  # a restarted container, same work dir: the last container's supervisor had our PID
        return None
    state = _state(work_dir) or {}
    if state.get("supervisor_pid") == pid and state.get("supervisor_start_ticks") is not None:
        return pid if same_process(pid, state["supervisor_start_ticks"]) else None
    argv = " ".join(proc_argv(pid))
    if pid_alive(pid) and ("tritonserver_backend.launcher.supervise" in argv or "tritonserver.py" in argv):
        return pid
    return None


def _supervise_argv(args: argparse.Namespace, pid_file: Path) -> list[str]:
    """The command line of the detached supervisor: this start's flags, paths made absolute."""
    argv = [sys.executable, "-m", "tritonserver_backend.launcher.supervise",
            "--model-repository", str(Path(args.model_repository).resolve()),
            "--work-dir", str(Path(args.work_dir).resolve()), "--pid-file", str(pid_file.resolve()),
            "--prefer", args.prefer, "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
            "--metrics-port", str(args.metrics_port), "--model-control-mode", args.model_control_mode,
            "--exit-timeout", str(args.exit_timeout), "--timeout", str(args.timeout),
            "--health-port", str(args.health_port), "--max-restarts", str(args.max_restarts),
            "--restart-window", str(args.restart_window), "--address", args.address]
    if args.log_file:
        argv += ["--log-file", str(Path(args.log_file).resolve())]
    if args.health_address:
        argv += ["--health-address", args.health_address]
    if args.operator_key_file:
        argv += ["--operator-key-file", str(Path(args.operator_key_file).resolve())]
    if args.openai_port:
        argv += ["--openai-port", str(args.openai_port)]
    for name in args.load_model:
        argv += ["--load-model", name]
    extra = list(args.extra_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return argv + (["--", *extra] if extra else [])


def _print_ready(state: dict, pid_file: Path) -> None:
    ports = state.get("ports") or {}
    if state.get("cleaned"):
        print(f"cleaned up {state['cleaned']}", flush=True)
    print(f"started PID {state.get('server_pid')}; log {state.get('log_file')}; PID file {pid_file}", flush=True)
    print(f"ready after {state.get('ready_after') or 0:.1f} s: HTTP http://{HOST}:{ports.get('http')}  "
          f"gRPC {HOST}:{ports.get('grpc')}  metrics http://{HOST}:{ports.get('metrics')}/metrics", flush=True)
    print(f"supervisor PID {state.get('supervisor_pid')}; health {state.get('health_url')}", flush=True)
    companion = state.get("companion") or {}
    if companion.get("port"):
        print(f"OpenAI frontend PID {companion.get('pid')}: http://{HOST}:{companion['port']}/v1; "
              f"log {companion.get('log_file')}", flush=True)


def _start_supervised(args: argparse.Namespace, pid_file: Path) -> int:
    """Run the supervisor here (--foreground) or detached, and wait until its state file says ready or failed."""
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / STATE_FILE_NAME).unlink(missing_ok=True)  # a previous run's state must not read as this one's
    if args.foreground:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
        (work_dir / PID_FILE_NAME).write_text(f"{os.getpid()}\n")  # so `stop` finds this supervisor
        try:
            try:
                sup = supervisor_from_args(args, announce=lambda line: print(line, flush=True))
            except (TritonNotFoundError, OSError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            if sup.probe is not None:
                print(f"supervisor PID {os.getpid()}; health {sup.probe.url}/health", flush=True)
            code = run_until_signalled(sup)
            if sup.failure or sup.give_up_reason:
                print(f"error: {sup.failure or sup.give_up_reason}", file=sys.stderr)
            return code
        finally:
            (work_dir / PID_FILE_NAME).unlink(missing_ok=True)
    log_path = work_dir / LOG_FILE_NAME
    with open(log_path, "ab") as log_fh:
        offset = log_fh.tell()
        proc = subprocess.Popen(_supervise_argv(args, pid_file), stdin=subprocess.DEVNULL, stdout=log_fh,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + args.timeout + 30
    while True:
        state = _state(work_dir) or {}
        if state.get("supervisor_pid") == proc.pid and state.get("state") == "ready":
            _print_ready(state, pid_file)
            print(f"supervisor log {log_path}", flush=True)
            return 0
        code = proc.poll()
        failed = state.get("supervisor_pid") == proc.pid and state.get("state") in ("failed", "gave_up")
        if code is not None or failed or time.monotonic() > deadline:
            reason = state.get("failure") or state.get("give_up_reason")
            if code is None:
                proc.terminate()
                try:
                    proc.wait(timeout=args.timeout + 30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            headline = reason or (f"the supervisor exited with code {code}" if code is not None
                                  else f"not ready after {args.timeout + 30:.0f} s")
            print(f"error: {headline}\n--- last lines of {log_path} ---\n{tail(log_path, 40, offset).rstrip()}",
                  file=sys.stderr)
            return 1
        time.sleep(0.2)


def _stop_supervisor(pid: int, grace: float, pid_file: Path, work_dir: Path) -> int | None:
    """SIGTERM the supervisor and wait until it has stopped its server; the exit code for `stop`, or None to go on
    with the clean-up by record (the supervisor had to be killed, or left the record behind)."""
    record = read_record(pid_file)
    info = proc_info(pid)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace + 30
    while same_process(pid, info.start_ticks if info else None) and time.monotonic() < deadline:
        time.sleep(0.1)
    if same_process(pid, info.start_ticks if info else None):
        print(f"supervisor PID {pid} did not stop within {grace + 30:.0f} s; killing it", file=sys.stderr)
        os.kill(pid, signal.SIGKILL)
        return None
    print(f"supervisor PID {pid}: stopped")
    if read_record(pid_file) is not None:
        return None
    state = _state(work_dir) or {}
    if record is not None:
        print(f"tritonserver PID {record.pid}: {state.get('stop_outcome') or 'terminated'}")
    return 0


def _print_supervisor(state: dict, alive: bool) -> None:
    def when(t: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"

    running = f"PID {state.get('supervisor_pid')}" + ("" if alive else " (not running)")
    print(f"supervisor: {state.get('state')} ({running}); restarts {state.get('restarts', 0)}; "
          f"health {state.get('health_url')}")
    for fault in state.get("faults") or []:
        healed = (f"healed after {fault['heal_seconds']:.1f} s" if fault.get("heal_seconds") is not None
                  else "not healed")
        detail = f" ({fault['detail']})" if fault.get("detail") else ""
        print(f"  fault: {fault.get('model')} (PID {fault.get('pid')}) {fault.get('kind')}{detail} at "
              f"{when(fault.get('detected_at'))}; {healed}")
    companion = state.get("companion") or {}
    if companion:
        print(f"  {companion.get('name')}: PID {companion.get('pid')} port {companion.get('port')} "
              f"({'running' if companion.get('running') else 'not running'})")
    if state.get("give_up_reason"):
        print(f"  {state['give_up_reason']}")
    if state.get("failure"):
        print(f"  failed: {state['failure'].splitlines()[0]}")


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def cmd_stop(args: argparse.Namespace) -> int:
    pid_file = _pid_file(args)
    supervisor = live_supervisor(Path(args.work_dir))
    if supervisor is not None:  # first, or it would start the server again
        code = _stop_supervisor(supervisor, args.grace, pid_file, Path(args.work_dir))
        if code is not None:
            return code
    record = read_record(pid_file)
    if record is None:
        print(f"not running (no PID in {pid_file})")
        return 3
    pid = record.pid
    if not record.server_alive():
        reused = pid_alive(pid)  # by another program, or by another tritonserver started since
        if reused:
            what = "a different tritonserver" if is_tritonserver(pid) else "not a tritonserver process"
            print(f"PID {pid} from {pid_file} is {what}; not touching it", file=sys.stderr)
        else:
            print(f"not running (PID {pid} from {pid_file} is gone; removed the stale PID file)")
        _clean_up_stale(pid_file)
        return 2 if reused else 3
    record.observe()  # the stubs and regions it has now, for the clean-up after the stop
    outcome = stop_pid(pid, grace=args.grace, regions=record.regions())
    if not record.server_alive():
        cleaned = clean_up_after(record)
        if cleaned.did_something:
            print(f"also removed {cleaned.summary()}")
    remove_record(pid_file, pid)
    print(f"tritonserver PID {pid}: {outcome}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    try:
        print(f"binary: {find_tritonserver(args.prefer).describe()}")
    except TritonNotFoundError as exc:
        print(f"binary: none ({exc})")
    pid_file = _pid_file(args)
    record = read_record(pid_file)
    pid = record.pid if record is not None else None
    info = record.to_json() if record is not None and record.info else {}
    http_port = args.http_port or info.get("http_port")
    running = record is not None and record.server_alive()
    work_dir = Path(args.work_dir)
    sup_state = _state(work_dir)
    sup_alive = live_supervisor(work_dir) is not None
    if sup_state is not None:
        _print_supervisor(sup_state, sup_alive)
    if sup_alive and sup_state is not None and sup_state.get("state") != "ready":
        print(f"ready: no (supervisor {sup_state.get('state')})")
        return 1
    if pid is not None:
        state = "running" if running else "not running (a stale record: `start` or `stop` cleans up after it)"
        print(f"PID {pid} (from {pid_file}): {state}")
    else:
        print(f"PID file {pid_file}: none")
    if info and running:
        print(f"ports: HTTP {info.get('http_port')}  gRPC {info.get('grpc_port')}  metrics {info.get('metrics_port')}"
              f"  (on {HOST}); log {info.get('log_file')}")
    if http_port:
        ready = http_ready(int(http_port))
        print(f"ready: {'yes' if ready else 'no'} (http://{HOST}:{http_port}/v2/health/ready)")
        if ready:
            return 0
        return 1 if running else 3
    return 1 if running else 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--work-dir", default=str(DEFAULT_WORK_DIR),
                       help="prepared backends, default log and PID file (default: %(default)s)")
        p.add_argument("--pid-file", help="default: WORK_DIR/tritonserver.pid")
        p.add_argument("--prefer", choices=("auto", "system", "wheel"), default="auto",
                       help="which tritonserver: system PATH first (auto), only system, only the pytriton wheel")

    start = sub.add_parser("start", help="start the server and wait until it is ready")
    common(start)
    start.add_argument("--model-repository", required=True)
    start.add_argument("--http-port", type=int, default=8000)
    start.add_argument("--grpc-port", type=int, default=8001)
    start.add_argument("--metrics-port", type=int, default=8002)
    start.add_argument("--log-file", help="server stdout+stderr (default: WORK_DIR/tritonserver.log)")
    start.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C / SIGTERM stops the server")
    start.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness")
    start.add_argument("--model-control-mode", choices=("none", "explicit"), default="none")
    start.add_argument("--load-model", action="append", default=[], help="with explicit mode; repeatable")
    start.add_argument("--exit-timeout", type=int, default=10, help="tritonserver --exit-timeout-secs")
    start.add_argument("--no-engine-build", action="store_true",
                       help="do not build or check the encoder's engines first (containers: an init container built "
                            "them into a read-only mount, where the build's lock file cannot be opened)")
    start.add_argument("--no-supervise", action="store_true",
                       help="start the bare server (no supervisor: a dead stub is not restarted)")
    start.add_argument("--session-dir",
                       help="the session journal's folder (docs/reliability.md): sessions survive a dead model "
                            "process and a stop + start; default WORK_DIR/sessions; 'off': sessions live in memory "
                            "only. The encoder's session_dir parameter, when set in the repository, wins")
    add_address_argument(start)
    add_supervisor_arguments(start)
    start.add_argument("extra_args", nargs=argparse.REMAINDER, help="after --: passed to tritonserver verbatim")
    start.set_defaults(func=cmd_start)

    stop = sub.add_parser("stop", help="stop the server named by the PID file")
    common(stop)
    stop.add_argument("--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    stop.set_defaults(func=cmd_stop)

    status = sub.add_parser("status", help="where the binary comes from, whether the server runs and is ready")
    common(status)
    status.add_argument("--http-port", type=int, help="default: the port recorded next to the PID file")
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
