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

The server leaves nothing behind: :meth:`TritonServer.stop` ends its whole process group (the server and its
``triton_python_backend_stub`` processes) and unlinks the ``/dev/shm/triton_python_backend_shm_region*`` files they
had, and the record next to the PID file lets the next start clean up after a server that was killed or crashed.

Modules, one job each:

==================  ================================================================================================
``install``         finding the binary (system PATH or the wheel), :class:`TritonInstall`, :func:`prepare_backend_dir`
``env``             the server's environment (:func:`server_env`) and the numpy<2 check (:func:`check_numpy`)
``net``             the loopback host, free ports, the readiness probe
``logs``            the log's tail, its error lines, the regions a verbose log names
``process``         PIDs and their identity, process groups, :func:`stop_pid`, left-over processes, shm regions
``record``          the record of a running server (``<pid_file>.json``) and the clean-up after a dead one
``server``          :class:`TritonServer`
``errors``          :class:`TritonNotFoundError`, :class:`TritonServerError`
==================  ================================================================================================
"""

from __future__ import annotations

from tritonserver_backend.launcher.env import check_numpy, server_env
from tritonserver_backend.launcher.errors import TritonNotFoundError, TritonServerError
from tritonserver_backend.launcher.install import TritonInstall, find_tritonserver, prepare_backend_dir
from tritonserver_backend.launcher.logs import error_lines, tail
from tritonserver_backend.launcher.net import HOST, free_port, http_ready
from tritonserver_backend.launcher.process import (
    group_members,
    is_tritonserver,
    mapped_shm_regions,
    pid_alive,
    stop_pid,
)
from tritonserver_backend.launcher.server import TritonServer

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
