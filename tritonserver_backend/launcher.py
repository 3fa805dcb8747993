"""Find, prepare, start, probe and stop a Triton Inference Server process (no Triton import, no pb_utils).

Two kinds of install are supported:

* a system ``tritonserver`` on ``PATH`` (an NGC Triton container), used with its own backends directory
  (``<prefix>/backends``, normally ``/opt/tritonserver/backends``);
* the server bundled in the ``nvidia-pytriton`` wheel (``pytriton/tritonserver/bin/tritonserver``). Its backends
  directory must be copied somewhere writable with the Python-backend stub for the running Python version put next to
  ``libtriton_python.so`` (:func:`prepare_backend_dir`), and the server needs the wheel's ``nvidia_pytriton.libs/`` on
  ``LD_LIBRARY_PATH`` (:func:`server_env`).

The Python-backend stub embeds a Python interpreter that finds its ``sys.prefix`` by looking ``python3`` up on
``PATH``; :func:`server_env` therefore puts the running interpreter's ``bin`` directory first, so model code sees this
virtual environment (torch, numpy<2). numpy 2 silently corrupts tensors with the 2.51 stub: :meth:`TritonServer.start`
refuses to start when it finds numpy>=2 in this environment.

Every address the server listens on is loopback (127.0.0.1).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

__all__ = [
    "HOST",
    "TritonInstall",
    "TritonNotFoundError",
    "TritonServer",
    "TritonServerError",
    "check_numpy",
    "error_lines",
    "find_tritonserver",
    "free_port",
    "group_members",
    "http_ready",
    "is_tritonserver",
    "mapped_shm_regions",
    "pid_alive",
    "prepare_backend_dir",
    "server_env",
    "stop_pid",
    "tail",
]

HOST = "127.0.0.1"
SYSTEM_PREFIX = Path("/opt/tritonserver")
STUB_NAME = "triton_python_backend_stub"
LOG_TAIL_LINES = 40
_ADDRESS_FLAGS = ("--http-address", "--grpc-address", "--metrics-address", "--sagemaker-port", "--vertex-ai-port",
                  "--allow-sagemaker", "--allow-vertex-ai")


class TritonNotFoundError(RuntimeError):
    """No usable ``tritonserver`` binary was found."""


class TritonServerError(RuntimeError):
    """The server failed to start, exited, or did not become ready; the message carries the log tail."""


@dataclasses.dataclass(frozen=True)
class TritonInstall:
    """Where a ``tritonserver`` binary and what it needs live.

    ``source`` is ``"system"`` (found on PATH) or ``"pytriton-wheel"``. For the wheel, ``wheel_dir`` is the wheel's
    ``pytriton/tritonserver`` directory and ``libs_dir`` its ``nvidia_pytriton.libs``; ``backend_dir`` is the wheel's
    read-only ``backends`` (pass it through :func:`prepare_backend_dir` before use).
    """

    binary: Path
    source: str
    backend_dir: Path | None
    wheel_dir: Path | None = None
    libs_dir: Path | None = None
    version: str | None = None

    @property
    def is_wheel(self) -> bool:
        return self.source == "pytriton-wheel"

    def describe(self) -> str:
        what = f"nvidia-pytriton {self.version} wheel" if self.is_wheel else "system PATH"
        backends = "backends copied from" if self.is_wheel else "backends"
        return f"{self.binary} (from the {what}; {backends} {self.backend_dir})"


def _pytriton_wheel_dir() -> Path | None:
    """The installed wheel's ``pytriton/tritonserver`` directory, found without importing pytriton."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "tritonserver"
        if candidate.is_dir():
            return candidate
    return None


def _pytriton_version() -> str | None:
    try:
        return importlib.metadata.version("nvidia-pytriton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_tritonserver(
    prefer: str = "auto",
    *,
    search_path: str | None = None,
    wheel_dir: Path | None = None,
) -> TritonInstall:
    """Locate a ``tritonserver``: a system one on PATH first (``prefer="auto"``), else the ``nvidia-pytriton`` wheel's.

    ``prefer`` is ``"auto"``, ``"system"`` or ``"wheel"``; ``search_path`` replaces ``$PATH`` and ``wheel_dir`` the
    installed wheel's ``pytriton/tritonserver`` directory (both for tests). Raises :class:`TritonNotFoundError`
    naming every place that was searched.
    """
    if prefer not in ("auto", "system", "wheel"):
        raise ValueError(f"prefer must be 'auto', 'system' or 'wheel', got {prefer!r}")
    searched: list[str] = []

    if prefer in ("auto", "system"):
        path = os.environ.get("PATH", "") if search_path is None else search_path
        found = shutil.which("tritonserver", path=path) if path else None
        searched.append(f"`tritonserver` on PATH ({path or '<empty>'})")
        if found:
            binary = Path(found).resolve()
            prefix = binary.parent.parent
            backend_dir = prefix / "backends" if (prefix / "backends").is_dir() else SYSTEM_PREFIX / "backends"
            return TritonInstall(binary=binary, source="system", backend_dir=backend_dir)

    if prefer in ("auto", "wheel"):
        wdir = _pytriton_wheel_dir() if wheel_dir is None else Path(wheel_dir)
        if wdir is None:
            searched.append("the nvidia-pytriton wheel (package `pytriton` is not installed in this Python: "
                            f"{sys.executable})")
        else:
            binary = wdir / "bin" / "tritonserver"
            searched.append(f"the nvidia-pytriton wheel binary {binary}")
            if _is_executable(binary):
                return TritonInstall(
                    binary=binary,
                    source="pytriton-wheel",
                    backend_dir=wdir / "backends",
                    wheel_dir=wdir,
                    libs_dir=wdir.parent.parent / "nvidia_pytriton.libs",
                    version=_pytriton_version(),
                )

    raise TritonNotFoundError(
        "no tritonserver found; searched: " + "; ".join(searched) + ". Install the server with "
        "`pip install nvidia-pytriton==0.7.0` (bundles Triton 2.51 with the Python backend) or run inside an NGC "
        "Triton container."
    )


def _stub_source(install: TritonInstall, python_version: str) -> Path:
    assert install.wheel_dir is not None
    stub = install.wheel_dir / "python_backend_stubs" / python_version / STUB_NAME
    if not stub.is_file():
        have = sorted(p.name for p in (install.wheel_dir / "python_backend_stubs").iterdir() if p.is_dir()
                      and (p / STUB_NAME).is_file()) if (install.wheel_dir / "python_backend_stubs").is_dir() else []
        raise TritonNotFoundError(
            f"the nvidia-pytriton wheel has no Python-backend stub for Python {python_version} (looked for {stub}; "
            f"stubs present for: {', '.join(have) or 'none'})"
        )
    return stub


def _same_file_content(src: Path, dst: Path) -> bool:
    try:
        s, d = src.stat(), dst.stat()
    except FileNotFoundError:
        return False
    return s.st_size == d.st_size and int(s.st_mtime) == int(d.st_mtime)


def _atomic_copy(src: Path, dst: Path) -> bool:
    """Copy ``src`` to ``dst`` (content, mode, mtime) unless it is already there; returns whether it copied."""
    if _same_file_content(src, dst):
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)
    return True


def prepare_backend_dir(
    install: TritonInstall,
    work_dir: Path | str,
    python_version: str | None = None,
) -> Path:
    """Return a backends directory the server can use; for the wheel, build it under ``work_dir/backends``.

    The wheel's ``backends/`` tree is copied (files that are already up to date are left alone, each copy is atomic, so
    calling this again, or from two processes, is safe) and the stub for ``python_version`` (default: the running
    Python's ``3.X``) is put next to ``python/libtriton_python.so``. A system install's own directory is returned
    unchanged.
    """
    if not install.is_wheel:
        if install.backend_dir is None or not install.backend_dir.is_dir():
            raise TritonNotFoundError(f"the system tritonserver {install.binary} has no backends directory "
                                      f"(looked for {install.backend_dir})")
        return install.backend_dir
    assert install.backend_dir is not None
    python_version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = _stub_source(install, python_version)
    target = Path(work_dir) / "backends"
    for src in sorted(install.backend_dir.rglob("*")):
        if src.is_file() and "__pycache__" not in src.parts:
            _atomic_copy(src, target / src.relative_to(install.backend_dir))
    _atomic_copy(stub, target / "python" / STUB_NAME)
    if not (target / "python" / "libtriton_python.so").is_file():
        raise TritonNotFoundError(f"{install.backend_dir} has no python/libtriton_python.so")
    return target


def _python_libdir() -> Path | None:
    """The running Python's shared-library directory when it holds ``libpython3.X.so.1.0`` (the stub links to it)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"
    if libdir and (Path(libdir) / soname).exists():
        return Path(libdir)
    return None


def server_env(
    install: TritonInstall,
    base: Mapping[str, str] | None = None,
    python_bin_dir: Path | str | None = None,
) -> dict[str, str]:
    """Environment for the server process.

    ``PATH`` starts with ``python_bin_dir`` (default: the directory of the running interpreter, i.e. the venv's
    ``bin``) so the Python-backend stub runs model code with this environment's packages. For the wheel,
    ``LD_LIBRARY_PATH`` gets the running Python's libdir (the stub needs a ``libpython3.X.so.1.0`` matching the
    interpreter found on ``PATH``) and the wheel's ``nvidia_pytriton.libs``.
    """
    env = dict(os.environ if base is None else base)
    bin_dir = Path(python_bin_dir) if python_bin_dir is not None else Path(sys.executable).parent
    env["PATH"] = os.pathsep.join([str(bin_dir)] + [p for p in env.get("PATH", "").split(os.pathsep) if p])
    if install.is_wheel:
        libs: list[str] = []
        pylib = _python_libdir()
        if pylib is not None:
            libs.append(str(pylib))
        if install.libs_dir is not None:
            libs.append(str(install.libs_dir))
        libs += [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(libs))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_numpy() -> str | None:
    """Raise when numpy>=2 is installed here (the 2.51 Python-backend stub corrupts its tensors); return its version."""
    try:
        version = importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        return None
    if int(version.split(".")[0]) >= 2:
        raise TritonServerError(
            f"numpy {version} is installed in {sys.prefix}; Triton 2.51's Python-backend stub silently corrupts "
            "tensors with numpy 2. Run `pip install 'numpy<2'` (or pass numpy_check=False)."
        )
    return version


def free_port(host: str = HOST) -> int:
    """A TCP port that is free on the loopback address right now (the kernel's pick; racy by nature, like any such)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _read_lines(path: Path | str, offset: int = 0) -> Iterator[str]:
    with open(path, "rb") as fh:
        fh.seek(offset)
        for raw in fh:
            yield raw.decode("utf-8", errors="replace")


def tail(path: Path | str | None, lines: int = LOG_TAIL_LINES, offset: int = 0) -> str:
    """The last ``lines`` lines of a text file from byte ``offset`` on ('' when it does not exist)."""
    if path is None:
        return ""
    try:
        return "".join(deque(_read_lines(path, offset), maxlen=lines))
    except FileNotFoundError:
        return ""


_ERROR_LINE = re.compile(r"^E\d{4} |UNAVAILABLE: ")


def error_lines(path: Path | str | None, limit: int = 20, offset: int = 0) -> list[str]:
    """Triton's error lines (``E1129 ...`` log lines, ``UNAVAILABLE:`` model-status rows) from byte ``offset`` of a
    log on, the first ``limit``."""
    if path is None:
        return []
    found: list[str] = []
    try:
        for line in _read_lines(path, offset):
            if _ERROR_LINE.search(line):
                found.append(line.rstrip("\n"))
                if len(found) >= limit:
                    break
    except FileNotFoundError:
        pass
    return found


def _proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (None when there is no such process)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited child not yet reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc_state(pid) not in (None, "Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def is_tritonserver(pid: int) -> bool:
    """Whether ``pid`` runs a ``tritonserver`` binary (guards against a PID file pointing at a reused PID)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv0 = fh.read().split(b"\0", 1)[0].decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return Path(argv0).name == "tritonserver"


def _signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (the server and its stubs), or to ``pid`` alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
            return
    except ProcessLookupError:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_pid(pid: int, grace: float = 20.0, popen: subprocess.Popen | None = None) -> str:
    """Stop the server ``pid``: SIGTERM to its process group, wait ``grace`` s, then SIGKILL; returns what happened.

    Returns ``"not running"``, ``"terminated"`` or ``"killed"``. Stub processes left in the group after the server
    ended are killed too, and Python-backend shared-memory regions (``/dev/shm/triton_python_backend_shm_region_*``)
    that the group had mapped and that a killed process left behind are unlinked.
    """

    def alive() -> bool:
        return popen.poll() is None if popen is not None else pid_alive(pid)

    if not alive():
        _kill_leftovers(pid)
        return "not running"
    regions = mapped_shm_regions([pid, *group_members(pid)])
    _signal_group(pid, signal.SIGTERM)
    outcome = "terminated"
    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:
        if popen is not None:
            try:
                popen.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
        else:
            time.sleep(0.1)
    if alive():
        regions |= mapped_shm_regions([pid, *group_members(pid)])
        _signal_group(pid, signal.SIGKILL)
        outcome = "killed"
        if popen is not None:
            popen.wait(timeout=10)
        else:
            deadline = time.monotonic() + 10
            while alive() and time.monotonic() < deadline:
                time.sleep(0.05)
    _kill_leftovers(pid)
    for region in regions:
        try:
            region.unlink()
        except (FileNotFoundError, PermissionError):
            pass
    return outcome


SHM_REGION_PREFIX = "/dev/shm/triton_python_backend_shm_region"


def mapped_shm_regions(pids: Iterable[int]) -> set[Path]:
    """Python-backend shared-memory files mapped by ``pids`` (read from /proc/PID/maps)."""
    found: set[Path] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(SHM_REGION_PREFIX):
                        found.add(Path(fields[5].rstrip("\n").removesuffix(" (deleted)")))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def _kill_leftovers(pgid: int, wait: float = 10.0) -> None:
    """SIGKILL whatever is still alive in the server's process group (orphaned Python-backend stubs), and wait
    until the group is really empty: a killed process lingers a moment before the kernel removes it."""
    deadline = time.monotonic() + wait
    while True:
        members = group_members(pgid)
        if not members or time.monotonic() > deadline:
            return
        for member in members:
            try:
                os.kill(member, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def http_ready(http_port: int, host: str = HOST, timeout: float = 1.0) -> bool:
    """Whether ``GET /v2/health/ready`` answers 200."""
    try:
        with urllib.request.urlopen(f"http://{host}:{http_port}/v2/health/ready", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


class TritonServer:
    """One ``tritonserver`` subprocess in its own process group, listening on loopback only.

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
        self._log_offset = 0

    # -- addresses -------------------------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{HOST}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/metrics"

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def build_command(
        self,
        model_repository: Path | str,
        backend_dir: Path,
        extra_args: Sequence[str] = (),
        model_control_mode: str = "none",
        load_models: Iterable[str] = (),
        exit_timeout: int = 10,
    ) -> list[str]:
        if model_control_mode not in ("none", "explicit"):
            raise ValueError(f"model_control_mode must be 'none' or 'explicit', got {model_control_mode!r}")
        load_models = list(load_models)
        if load_models and model_control_mode != "explicit":
            raise ValueError("load_models needs model_control_mode='explicit'")
        for arg in extra_args:
            if arg.split("=", 1)[0] in _ADDRESS_FLAGS:
                raise ValueError(f"{arg!r}: the server listens on {HOST} only; addresses cannot be overridden")
        cmd = [
            str(self.install.binary),
            f"--model-repository={Path(model_repository).resolve()}",
            f"--backend-directory={backend_dir}",
            f"--http-address={HOST}",
            f"--http-port={self.http_port}",
            f"--grpc-address={HOST}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={HOST}",
            f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            f"--model-control-mode={model_control_mode}",
            f"--exit-timeout-secs={exit_timeout}",
        ]
        cmd += [f"--load-model={name}" for name in load_models]
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
    ) -> "TritonServer":
        """Start the server (without waiting for it: call :meth:`wait_ready`). Ports default to free loopback ports;
        stdout and stderr go to ``log_file`` (default ``work_dir/tritonserver.log``); the PID goes to ``pid_file``
        (default ``work_dir/tritonserver.pid``) and a JSON description next to it (``<pid_file>.json``).

        ``exit_timeout`` is Triton's ``--exit-timeout-secs``: after SIGTERM it waits that long for in-flight requests
        and open client connections (a keep-alive HTTP client counts) before exiting; :meth:`stop` waits that plus
        10 s before SIGKILL. ``extra_args`` are appended verbatim (e.g. ``--log-verbose=1``)."""
        if self.process is not None and self.process.poll() is None:
            raise TritonServerError(f"this TritonServer already runs PID {self.pid}")
        repo = Path(model_repository)
        if not repo.is_dir():
            raise TritonServerError(f"model repository {repo} is not a directory")
        if numpy_check:
            check_numpy()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        backend_dir = prepare_backend_dir(self.install, self.work_dir)
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        if len({self.http_port, self.grpc_port, self.metrics_port}) != 3:
            raise ValueError(f"ports must differ: http {self.http_port}, grpc {self.grpc_port}, "
                             f"metrics {self.metrics_port}")
        self.log_file = Path(log_file) if log_file is not None else self.work_dir / "tritonserver.log"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file = Path(pid_file) if pid_file is not None else self.work_dir / "tritonserver.pid"
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.exit_timeout = exit_timeout
        self.command = self.build_command(repo, backend_dir, extra_args, model_control_mode, load_models,
                                          exit_timeout)
        env = server_env(self.install, python_bin_dir=self.python_bin_dir)
        with open(self.log_file, "ab") as log:
            self._log_offset = log.tell()  # the log is appended to: tails and error lines read this run's part only
            log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.work_dir,
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        self.ready_after = None
        self.pid = self.process.pid
        self.pid_file.write_text(f"{self.pid}\n")
        self.pid_file.with_name(self.pid_file.name + ".json").write_text(json.dumps(self.describe(), indent=2) + "\n")
        return self

    def describe(self) -> dict:
        return {
            "pid": self.pid,
            "binary": str(self.install.binary),
            "source": self.install.source,
            "pytriton_version": self.install.version,
            "host": HOST,
            "http_port": self.http_port,
            "grpc_port": self.grpc_port,
            "metrics_port": self.metrics_port,
            "log_file": str(self.log_file) if self.log_file else None,
            "command": self.command,
        }

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
            code = self.process.poll()
            if code is not None:
                raise TritonServerError(self._failure(f"tritonserver (PID {self.pid}) exited with code {code} "
                                                      "before it was ready"))
            if http_ready(self.http_port):
                self.ready_after = time.monotonic() - (self.started_at or time.monotonic())
                return self.ready_after
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

        Returns what :func:`stop_pid` reports (``"terminated"``, ``"killed"``, ``"not running"``), or None when it was
        never started. Removes the PID file."""
        if self.pid is None:
            return None
        grace = self.exit_timeout + 10.0 if grace is None else grace
        outcome = stop_pid(self.pid, grace=grace, popen=self.process)
        if self.process is not None and self.process.poll() is None:  # pragma: no cover - stop_pid waited already
            self.process.wait(timeout=5)
        if self.pid_file is not None:
            try:
                if self.pid_file.read_text().strip() == str(self.pid):
                    self.pid_file.unlink()
                    self.pid_file.with_name(self.pid_file.name + ".json").unlink(missing_ok=True)
            except FileNotFoundError:
                pass
        return outcome

    def detach(self) -> int | None:
        """Forget the process handle so this object no longer stops the server (a CLI leaving it running); returns
        the PID. The PID file stays; stop it later with :func:`stop_pid` or ``scripts/tritonserver.py stop``."""
        pid, self.process, self.pid = self.pid, None, None
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
