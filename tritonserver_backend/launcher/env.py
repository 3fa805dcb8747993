"""The server's environment: which Python the Python-backend stub runs model code with, and the numpy it may see.

The Python-backend stub embeds a Python interpreter that finds its ``sys.prefix`` by looking ``python3`` up on
``PATH``; :func:`server_env` therefore puts the running interpreter's ``bin`` directory first, so model code sees this
virtual environment (torch, numpy<2). numpy 2 silently corrupts tensors with the 2.51 stub: :func:`check_numpy`
refuses it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import sysconfig
from pathlib import Path
from typing import Mapping

from tritonserver_backend.launcher.errors import TritonServerError
from tritonserver_backend.launcher.install import TritonInstall


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
