"""``python -m tritonserver_backend.launcher.supervise``: run a :class:`~.supervisor.Supervisor` as a process.

``scripts/tritonserver.py start`` spawns this (detached, output to ``<work_dir>/supervisor.log``) and waits until the
state file says ready or failed; ``--foreground`` runs :func:`run_until_signalled` in the CLI's own process.
SIGTERM and SIGINT stop the supervisor and its server cleanly. Exit codes: 0 after a stop, 1 after a failed first
start or a give-up.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from tritonserver_backend.auth.admin_auth import key_file_path
from tritonserver_backend.contract import ADMIN
from tritonserver_backend.launcher.companion import Companion
from tritonserver_backend.launcher.install import find_tritonserver
from tritonserver_backend.launcher.net import HOST
from tritonserver_backend.launcher.restart_policy import RestartPolicy
from tritonserver_backend.launcher.server import ALL_INTERFACES, BIND_ADDRESSES, TritonServer
from tritonserver_backend.launcher.supervisor import Supervisor

STATE_FILE_NAME = "supervisor.json"
PID_FILE_NAME = "supervisor.pid"
LOG_FILE_NAME = "supervisor.log"
DEFAULT_HEALTH_PORT = 8003
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # scripts/openai_server.py lives in the checkout
_PARAMETER = re.compile(r'key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}')


def operator_key_file_for(model_repository: Path | str) -> Path | None:
    """The adapter_admin key file of the server that ``model_repository`` configures (its ``admin_key_file``
    parameter, else ``<registry_root>/admin.key``; relative paths are relative to the repository's parent, environment
    variables expanded, as the models resolve them), or None without an ``adapter_admin`` model. Why this key: it is
    the one secret the operator of this server already holds (docs/admin.md), so the full ``/health`` needs no other."""
    config = Path(model_repository) / ADMIN.name / "config.pbtxt"
    try:
        params = dict(_PARAMETER.findall(config.read_text()))
    except (OSError, UnicodeDecodeError):
        return None
    root = Path(model_repository).resolve().parent

    def resolve(value: str) -> Path:
        path = Path(os.path.expandvars(value))
        return path if path.is_absolute() else root / path

    registry_root = params.get("registry_root") or "artifacts/registry"
    key_file = params.get("admin_key_file") or None
    return key_file_path(resolve(registry_root), resolve(key_file) if key_file else None)


def add_supervisor_arguments(parser: argparse.ArgumentParser) -> None:
    """The supervisor's own flags (shared with ``scripts/tritonserver.py start``)."""
    parser.add_argument("--health-port", type=int, default=DEFAULT_HEALTH_PORT,
                        help="the supervisor's /health, /health/live, /health/ready (0: a free port; "
                             "default %(default)s)")
    parser.add_argument("--health-address", default=None,
                        help="address the health probe listens on (default: loopback 127.0.0.1); other peers than "
                             "loopback get /health's public view unless they send the operator key")
    parser.add_argument("--operator-key-file", default=None,
                        help="the key that unlocks the full /health for a non-loopback peer (header mol2-admin-key or "
                             "Authorization: Bearer); default: the adapter_admin key file the model repository names")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="give up after this many restarts within --restart-window (default %(default)s)")
    parser.add_argument("--restart-window", type=float, default=600.0,
                        help="seconds over which restarts are counted (default %(default)s)")
    parser.add_argument("--openai-port", type=int, default=None,
                        help="also run the OpenAI frontend (scripts/openai_server.py) on this port, started after "
                             "Triton is ready and restarted when it exits; readiness then needs it too")


def add_address_argument(parser: argparse.ArgumentParser) -> None:
    """``--address``: what tritonserver binds (shared with ``scripts/tritonserver.py start``, so the detached
    supervisor gets the CLI's value under the same name)."""
    parser.add_argument("--address", choices=BIND_ADDRESSES, default=HOST,
                        help="address tritonserver's HTTP, gRPC and metrics listeners bind (default: loopback "
                             f"%(default)s); {ALL_INTERFACES} is for containers, whose ports the pod network reaches. "
                             "Readiness and the supervisor's checks stay on loopback")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tritonserver_backend.launcher.supervise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--pid-file", help="the server's PID file (default WORK_DIR/tritonserver.pid)")
    parser.add_argument("--log-file", help="the server's log (default WORK_DIR/tritonserver.log)")
    parser.add_argument("--prefer", choices=("auto", "system", "wheel"), default="auto")
    parser.add_argument("--http-port", type=int, default=0)
    parser.add_argument("--grpc-port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--model-control-mode", choices=("none", "explicit"), default="none")
    parser.add_argument("--load-model", action="append", default=[])
    parser.add_argument("--exit-timeout", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness at each start")
    add_address_argument(parser)
    add_supervisor_arguments(parser)
    parser.add_argument("extra_args", nargs=argparse.REMAINDER, help="after --: passed to tritonserver verbatim")
    return parser


def start_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """:meth:`TritonServer.start`'s keyword arguments for the parsed ``start`` flags; no side effects, so that
    tests/deploy can build the command line an image's entrypoint leads to with this very code."""
    work_dir = Path(args.work_dir)
    pid_file = Path(args.pid_file) if args.pid_file else work_dir / "tritonserver.pid"
    extra = list(args.extra_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return dict(model_repository=args.model_repository, http_port=args.http_port or None,
                grpc_port=args.grpc_port or None, metrics_port=args.metrics_port or None,
                log_file=args.log_file, extra_args=extra, model_control_mode=args.model_control_mode,
                load_models=list(args.load_model), pid_file=pid_file, exit_timeout=args.exit_timeout,
                bind_address=args.address)


def supervisor_from_args(args: argparse.Namespace, announce: Any = None) -> Supervisor:
    """A supervisor for the parsed ``start`` flags (the CLI's and this module's share their names)."""
    install = find_tritonserver(args.prefer)
    work_dir = Path(args.work_dir)
    start_kwargs = start_kwargs_from_args(args)
    kwargs: dict[str, Any] = {}
    if args.health_address:
        kwargs["health_host"] = args.health_address
    kwargs["operator_key_file"] = (Path(args.operator_key_file) if args.operator_key_file
                                   else operator_key_file_for(args.model_repository))
    if args.openai_port:
        kwargs["companion"] = openai_frontend(args.openai_port, work_dir / "openai_frontend.log")
    return Supervisor(lambda: TritonServer(install, work_dir=work_dir), start_kwargs,
                      health_port=args.health_port, policy=RestartPolicy(args.max_restarts, args.restart_window),
                      state_file=work_dir / STATE_FILE_NAME, ready_timeout=args.timeout, announce=announce, **kwargs)


def openai_frontend(port: int, log_file: Path) -> Callable[[dict[str, Any]], Companion]:
    """A factory of the OpenAI frontend process for Triton's fixed gRPC port (the supervisor calls it per start)."""
    script = PROJECT_ROOT / "scripts" / "openai_server.py"

    def make(start_kwargs: dict[str, Any]) -> Companion:
        argv = [sys.executable, str(script), "--triton-url", f"{HOST}:{start_kwargs['grpc_port']}", "--port", str(port)]
        return Companion("openai_frontend", argv, log_file, cwd=PROJECT_ROOT, port=port)

    return make


def run_until_signalled(sup: Supervisor) -> int:
    """Run ``sup`` in a thread until it ends or SIGTERM/SIGINT arrives (then stop it cleanly); its exit code.

    Why a thread: a signal handler that raised in the middle of a restart could leave a half-started server; here the
    handler only sets a flag, and the stop runs in order."""
    asked = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        asked.set()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        thread = sup.start_thread()
        while thread.is_alive() and not asked.wait(0.2):
            pass
        if asked.is_set():
            logging.getLogger(__name__).info("supervisor: stop signal received")
            sup.stop(join=600)
        thread.join()
        return sup.exit_code if sup.exit_code is not None else 1
    finally:
        sup.close_probe()
        for sig, handler in old.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    pid_file = work_dir / PID_FILE_NAME
    pid_file.write_text(f"{os.getpid()}\n")
    try:
        sup = supervisor_from_args(args, announce=lambda line: print(line, flush=True))
        return run_until_signalled(sup)
    finally:
        try:
            if pid_file.read_text().strip() == str(os.getpid()):
                pid_file.unlink()
        except FileNotFoundError:
            pass


if __name__ == "__main__":
    sys.exit(main())
