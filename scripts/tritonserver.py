"""Start, stop and probe a local Triton Inference Server (loopback only) for this project's model repository.

    .venv/bin/python scripts/tritonserver.py start --model-repository model_repository [--http-port 8000]
        [--grpc-port 8001] [--metrics-port 8002] [--pid-file F] [--log-file L] [--foreground] [-- EXTRA_ARGS...]
    .venv/bin/python scripts/tritonserver.py stop [--pid-file F]
    .venv/bin/python scripts/tritonserver.py status [--pid-file F] [--http-port P]

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
import signal
import sys
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
from tritonserver_backend.launcher.record import clean_up_after, read_record, remove_record

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
    try:
        install = find_tritonserver(args.prefer)
    except TritonNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"binary: {install.describe()}", flush=True)
    if ensure_engines(Path(args.model_repository)) != 0:
        return 1
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


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def cmd_stop(args: argparse.Namespace) -> int:
    pid_file = _pid_file(args)
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
