"""One ``tritonserver`` subprocess: start it (loopback by default), wait until it is ready, stop it leaving nothing
behind.

The server gets a session (and process group) of its own, so SIGTERM/SIGKILL reach it and its Python-backend stubs
together. While it runs, the record next to the PID file (:mod:`.record`) says which stubs and shared-memory regions
it has; :meth:`TritonServer.stop` ends the group and unlinks those regions, and the next :meth:`TritonServer.start`
with the same PID file cleans up after a server that died without a stop.

``bind_address`` (:meth:`TritonServer.start`) is loopback unless a container asks for every interface (``0.0.0.0``:
a pod's Service and probes reach it from outside the container). Readiness is always polled on loopback, which reaches
both, so no other address is accepted: a server bound to one external interface would never be seen ready.
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable, Sequence

from tritonserver_backend.launcher.env import check_numpy, server_env
from tritonserver_backend.launcher.errors import TritonServerError
from tritonserver_backend.launcher.install import TritonInstall, find_tritonserver, prepare_backend_dir
from tritonserver_backend.launcher.logs import LOG_TAIL_LINES, aborted_on_lock, error_lines, model_failures, tail
from tritonserver_backend.launcher.net import HOST, free_port, http_ready
from tritonserver_backend.launcher.process import pid_alive, stop_pid
from tritonserver_backend.launcher.record import (
    Cleanup,
    ServerRecord,
    clean_up_after,
    read_record,
    remove_record,
    write_record,
)
from tritonserver_backend.launcher.start_log import note_start

# mol2-* request headers (the adapter_admin key, docs/admin.md) reach the models as request parameters
_HEADER_FORWARD_FLAGS = ("--grpc-header-forward-pattern", "--http-header-forward-pattern")
HEADER_FORWARD_PATTERN = "mol2-.*"
_GPU_METRICS_FLAG = "--allow-gpu-metrics"
ALL_INTERFACES = "0.0.0.0"  # containers only: the pod network must reach the server
BIND_ADDRESSES = (HOST, ALL_INTERFACES)  # both answer on loopback, where readiness and the supervisor look
_ADDRESS_FLAGS = ("--http-address", "--grpc-address", "--metrics-address", "--sagemaker-port", "--vertex-ai-port",
                  "--allow-sagemaker", "--allow-vertex-ai")

log = logging.getLogger(__name__)


def check_bind_address(bind_address: str) -> str:
    """``bind_address`` when it is one the launcher can watch (:data:`BIND_ADDRESSES`), else ValueError saying why."""
    if bind_address not in BIND_ADDRESSES:
        raise ValueError(f"bind address {bind_address!r}: use {HOST} (the default) or {ALL_INTERFACES} (containers); "
                         f"readiness is polled on {HOST}, which a server bound to another address does not answer")
    return bind_address


class TritonServer:
    """One ``tritonserver`` subprocess in its own process group, listening on loopback (or, in a container, on every
    interface: ``start(..., bind_address="0.0.0.0")``).

    ``work_dir`` (default: a new temporary directory) holds the prepared backends, the log and the PID file.

    Use::

        with TritonServer(work_dir=tmp) as server:
            server.start("model_repository")
            server.wait_ready(60)
            client = tritonclient.http.InferenceServerClient(server.http_url)
    """

    def __init__(
        self,
        install: TritonInstall | None = None,
        work_dir: Path | str | None = None,
        python_bin_dir: Path | str | None = None,
    ) -> None:
        self.install = install or find_tritonserver()
        self.work_dir = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="tritonserver-"))
        self.python_bin_dir = python_bin_dir
        self.process: subprocess.Popen | None = None
        self.pid: int | None = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None
        self.log_file: Path | None = None
        self.pid_file: Path | None = None
        self.command: list[str] = []
        self.started_at: float | None = None
        self.ready_after: float | None = None
        self.exit_timeout = 10
        self.bind_address = HOST  # what the server listens on; clients here and readiness polls use HOST regardless
        self.record: ServerRecord | None = None
        self.cleaned: Cleanup | None = None  # what start() cleaned up after a dead server named by the PID file
        self.stop_cleanup: Cleanup | None = None  # what stop() found left behind (recorded stubs, regions)
        self._log_offset = 0
        self._start_args: dict[str, object] = {}
        self.lock_abort_restarts = 0  # runs restarted by wait_ready after the Python backend's lock_exception abort
        self.healing = False  # started by a supervisor in place of a dead server (the start log counts it apart)

    # -- addresses ----------------------------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{HOST}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/metrics"

    # -- lifecycle ----------------------------------------------------------------------------------------------------
    def build_command(
        self,
        model_repository: Path | str,
        backend_dir: Path,
        extra_args: Sequence[str] = (),
        model_control_mode: str = "none",
        load_models: Iterable[str] = (),
        exit_timeout: int = 10,
        bind_address: str = HOST,
    ) -> list[str]:
        """The server's command line; the three listeners bind ``bind_address`` (:func:`check_bind_address`), which
        ``extra_args`` may not override (no address flags there)."""
        check_bind_address(bind_address)
        if model_control_mode not in ("none", "explicit"):
            raise ValueError(f"model_control_mode must be 'none' or 'explicit', got {model_control_mode!r}")
        load_models = list(load_models)
        if load_models and model_control_mode != "explicit":
            raise ValueError("load_models needs model_control_mode='explicit'")
        for arg in extra_args:
            if arg.split("=", 1)[0] in _ADDRESS_FLAGS:
                raise ValueError(f"{arg!r}: addresses come from bind_address (default {HOST} only, {ALL_INTERFACES} "
                                 "in containers), not from extra arguments")
        cmd = [
            str(self.install.binary),
            f"--model-repository={Path(model_repository).resolve()}",
            f"--backend-directory={backend_dir}",
            f"--http-address={bind_address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={bind_address}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={bind_address}",
            f"--metrics-port={self.metrics_port}",
            f"--model-control-mode={model_control_mode}",
            f"--exit-timeout-secs={exit_timeout}",
        ]
        cmd += [f"--load-model={name}" for name in load_models]
        given = {arg.split("=", 1)[0] for arg in extra_args}
        cmd += [f"{flag}={HEADER_FORWARD_PATTERN}" for flag in _HEADER_FORWARD_FLAGS if flag not in given]
        if _GPU_METRICS_FLAG not in given:  # off on CPU machines; a GPU node's image passes it on (extra args)
            cmd.append(f"{_GPU_METRICS_FLAG}=false")
        cmd += list(extra_args)
        return cmd

    def start(
        self,
        model_repository: Path | str,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        log_file: Path | str | None = None,
        extra_args: Sequence[str] = (),
        model_control_mode: str = "none",
        load_models: Iterable[str] = (),
        pid_file: Path | str | None = None,
        numpy_check: bool = True,
        exit_timeout: int = 10,
        bind_address: str = HOST,
    ) -> "TritonServer":
        """Start the server (without waiting for it: call :meth:`wait_ready`). Ports default to free ones (free on the
        bind address); stdout and stderr go to ``log_file`` (default ``work_dir/tritonserver.log``); the PID goes to
        ``pid_file`` (default ``work_dir/tritonserver.pid``) and a JSON record next to it (``<pid_file>.json``, see
        :mod:`tritonserver_backend.launcher.record`).

        When that record names a server that no longer runs (killed, crashed), what it left behind (stubs still in
        its process group or recorded, shared-memory regions nobody uses) is cleaned up first: :attr:`cleaned` says
        what, and a line in the log too. When it names a server that still runs, this raises
        :class:`TritonServerError` instead of losing track of it.

        ``exit_timeout`` is Triton's ``--exit-timeout-secs``: after SIGTERM it waits that long for in-flight requests
        and open client connections (a keep-alive HTTP client counts) before exiting; :meth:`stop` waits that plus
        10 s before SIGKILL. ``extra_args`` are appended verbatim (e.g. ``--log-verbose=1``).

        ``bind_address`` is where the three listeners bind: loopback, or ``0.0.0.0`` in a container whose ports the
        pod network must reach (:func:`check_bind_address`); the URLs and the readiness poll stay on loopback."""
        if self.process is not None and self.process.poll() is None:
            raise TritonServerError(f"this TritonServer already runs PID {self.pid}")
        self._start_args = dict(model_repository=model_repository, http_port=http_port, grpc_port=grpc_port,
                                metrics_port=metrics_port, log_file=log_file, extra_args=extra_args,
                                model_control_mode=model_control_mode, load_models=load_models,
                                pid_file=pid_file, numpy_check=numpy_check, exit_timeout=exit_timeout,
                                bind_address=bind_address)
        check_bind_address(bind_address)  # before anything is cleaned up or prepared
        repo = Path(model_repository)
        if not repo.is_dir():
            raise TritonServerError(f"model repository {repo} is not a directory")
        if numpy_check:
            check_numpy()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.pid_file = Path(pid_file) if pid_file is not None else self.work_dir / "tritonserver.pid"
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.cleaned = self.clean_up_stale(self.pid_file)
        backend_dir = prepare_backend_dir(self.install, self.work_dir)
        self.http_port = http_port or free_port(bind_address)  # free on every interface it will bind
        self.grpc_port = grpc_port or free_port(bind_address)
        self.metrics_port = metrics_port or free_port(bind_address)
        if len({self.http_port, self.grpc_port, self.metrics_port}) != 3:
            raise ValueError(f"ports must differ: http {self.http_port}, grpc {self.grpc_port}, "
                             f"metrics {self.metrics_port}")
        self.log_file = Path(log_file) if log_file is not None else self.work_dir / "tritonserver.log"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.exit_timeout = exit_timeout
        self.bind_address = bind_address
        self.command = self.build_command(repo, backend_dir, extra_args, model_control_mode, load_models,
                                          exit_timeout, bind_address)
        env = server_env(self.install, python_bin_dir=self.python_bin_dir)
        with open(self.log_file, "ab") as log_fh:
            self._log_offset = log_fh.tell()  # the log is appended to: tails and error lines read this run's part only
            now = time.strftime("%Y-%m-%d %H:%M:%S")
            if self.cleaned is not None:
                log_fh.write(f"# {now} cleaned up {self.cleaned.summary()}\n".encode())
            log_fh.write(f"# {now} starting: {' '.join(self.command)}\n".encode())
            log_fh.flush()
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.work_dir,
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        kind = "tritonserver" if (Path(repo) / "encoder").is_dir() else "tritonserver-toy"
        note_start(f"{kind}-heal" if self.healing else kind, str(repo))
        self.ready_after = None
        self.pid = self.process.pid
        self.record = ServerRecord.for_process(self.pid, self.describe(), self.log_file, self._log_offset)
        write_record(self.pid_file, self.record)
        return self

    @staticmethod
    def clean_up_stale(pid_file: Path | str) -> Cleanup | None:
        """Clean up after the server that ``pid_file``'s record names, when it no longer runs; remove the record.

        Returns what was done (None when there was no record). Raises :class:`TritonServerError` when the recorded
        server still runs."""
        record = read_record(pid_file)
        if record is None:
            return None
        if record.server_alive():
            raise TritonServerError(f"tritonserver PID {record.pid} from {pid_file} is still running; stop it first "
                                    f"(scripts/tritonserver.py stop --pid-file {pid_file})")
        cleaned = clean_up_after(record)
        remove_record(pid_file, record.pid)
        if cleaned.did_something or cleaned.not_ours:
            log.warning("cleaned up %s", cleaned.summary())
        return cleaned

    def describe(self) -> dict:
        return {
            "pid": self.pid,
            "binary": str(self.install.binary),
            "source": self.install.source,
            "pytriton_version": self.install.version,
            "host": HOST,
            "bind_address": self.bind_address,
            "http_port": self.http_port,
            "grpc_port": self.grpc_port,
            "metrics_port": self.metrics_port,
            "log_file": str(self.log_file) if self.log_file else None,
            "command": self.command,
        }

    def snapshot(self) -> ServerRecord | None:
        """Record the stubs and shared-memory regions the running server has now (rewrites the record when something
        is new). Called on every readiness poll, after ready and at stop; call it after loading a model later."""
        if self.record is None or not self.is_running():
            return self.record
        if self.record.observe() and self.pid_file is not None:
            write_record(self.pid_file, self.record)
        return self.record

    def is_running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return self.pid is not None and pid_alive(self.pid)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines this run wrote to the log."""
        return tail(self.log_file, lines, self._log_offset)

    def wait_ready(self, timeout: float = 120.0, poll: float = 0.2, stop_on_failure: bool = True) -> float:
        """Poll ``/v2/health/ready`` until it answers 200; returns the seconds since :meth:`start`.

        Raises :class:`TritonServerError` with the last 40 log lines as soon as the process exits, or when ``timeout``
        passes (the server is then stopped unless ``stop_on_failure`` is false)."""
        if self.process is None or self.http_port is None:
            raise TritonServerError("wait_ready() before start()")
        deadline = time.monotonic() + timeout
        while True:
            self.snapshot()  # stubs come and go while models load; a crash now must not leak them
            code = self.process.poll()
            if code is not None and self.lock_abort_restarts == 0 and aborted_on_lock(self.log_file, self._log_offset):
                # the Python backend's intermittent abort while models load (logs.aborted_on_lock): once more
                log.warning("tritonserver (PID %s) aborted while loading models (boost::interprocess::lock_exception, "
                            "an intermittent Python-backend race); starting it once more", self.pid)
                self.lock_abort_restarts += 1
                self.stop()  # its stubs and shared-memory regions go first
                self.start(**self._start_args)  # type: ignore[arg-type]
                continue
            if code is not None:
                raise TritonServerError(self._failure(f"tritonserver (PID {self.pid}) exited with code {code} "
                                                      "before it was ready"))
            if http_ready(self.http_port):
                self.ready_after = time.monotonic() - (self.started_at or time.monotonic())
                self.snapshot()
                return self.ready_after
            failed = model_failures(self.log_file, self._log_offset)
            if failed:  # it would never get ready: say why now instead of at the timeout
                message = self._failure(f"tritonserver (PID {self.pid}): a model cannot start, so the server will "
                                        "not become ready:\n  " + "\n  ".join(failed))
                if stop_on_failure:
                    self.stop()
                raise TritonServerError(message)
            if time.monotonic() >= deadline:
                message = self._failure(f"tritonserver (PID {self.pid}) not ready after {timeout:.0f} s "
                                        f"(polled http://{self.http_url}/v2/health/ready)")
                if stop_on_failure:
                    self.stop()
                raise TritonServerError(message)
            time.sleep(poll)

    def _failure(self, headline: str) -> str:
        last = self.log_tail().rstrip()
        message = f"{headline}; binary {self.install.describe()}; log {self.log_file}\n"
        errors = [line for line in error_lines(self.log_file, offset=self._log_offset) if line not in last]
        if errors:  # errors that scrolled out of the tail (e.g. a failed model above a long options table)
            message += "--- error lines earlier in the server log ---\n" + "\n".join(errors) + "\n"
        return message + f"--- last {LOG_TAIL_LINES} lines of the server log ---\n{last}"

    def stop(self, grace: float | None = None) -> str | None:
        """Stop the server by PID (SIGTERM to its group, SIGKILL after ``grace`` s, default exit_timeout + 10); safe to
        call again.

        Whatever is left afterwards is removed too: members of its process group, recorded stubs that left it, and
        the shared-memory regions the server's processes had (recorded or mapped now) that no live process uses
        (:attr:`stop_cleanup` says what was found). Returns what :func:`stop_pid` reports (``"terminated"``,
        ``"killed"``, ``"not running"``), or None when it was never started. Removes the PID file and its record."""
        if self.pid is None:
            return None
        grace = self.exit_timeout + 10.0 if grace is None else grace
        record = self.snapshot()
        outcome = stop_pid(self.pid, grace=grace, popen=self.process,
                           regions=record.regions() if record is not None else ())
        if self.process is not None and self.process.poll() is None:  # pragma: no cover - stop_pid waited already
            self.process.wait(timeout=5)
        if record is not None and not record.server_alive():
            self.stop_cleanup = clean_up_after(record)
        if self.pid_file is not None:
            remove_record(self.pid_file, self.pid)
        return outcome

    def detach(self) -> int | None:
        """Forget the process handle so this object no longer stops the server (a CLI leaving it running); returns
        the PID. The PID file and its record stay; stop it later with :func:`stop_pid` or
        ``scripts/tritonserver.py stop`` (which also cleans up by the record)."""
        pid, self.process, self.pid, self.record = self.pid, None, None, None
        return pid

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort: never leave a server behind a garbage-collected handle
        try:
            if self.process is not None and self.process.poll() is None:
                self.stop(grace=5.0)
        except Exception:
            pass
