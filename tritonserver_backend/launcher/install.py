"""Finding a ``tritonserver`` binary (a system one on PATH, or the one in the ``nvidia-pytriton`` wheel) and preparing
the backends directory it runs with.

The wheel's ``backends/`` is read-only and has no Python-backend stub next to ``libtriton_python.so``: the stubs for
each Python version live in ``python_backend_stubs/3.X/``. :func:`prepare_backend_dir` copies the tree somewhere
writable and puts the stub for the running Python in place.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from tritonserver_backend.launcher.errors import TritonNotFoundError

SYSTEM_PREFIX = Path("/opt/tritonserver")
STUB_NAME = "triton_python_backend_stub"


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
    stubs = install.wheel_dir / "python_backend_stubs"
    stub = stubs / python_version / STUB_NAME
    if not stub.is_file():
        have: list[str] = []
        if stubs.is_dir():
            have = sorted(p.name for p in stubs.iterdir() if p.is_dir() and (p / STUB_NAME).is_file())
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
