"""Reading the server log: its tail, Triton's error lines, and the shared-memory regions it named for its stubs.

The log is appended to across runs; every reader takes a byte ``offset`` so it sees one run's part only.
"""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path
from typing import Iterator

from tritonserver_backend.launcher.process import SHM_REGION_NAME

LOG_TAIL_LINES = 40


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


# Triton 2.51's Python backend now and then aborts while models load ("terminate called after throwing an instance of
# 'boost::interprocess::lock_exception'", signal 6): an upstream race on its shared-memory locks, reported for
# other versions too (triton-inference-server/server#8882, tensorrtllm_backend#521). It depends on timing, not on
# the repository, so the launcher starts the server once more when a run dies of it before it was ready.
_LOAD_ABORT = "boost::interprocess::lock_exception"


def aborted_on_lock(path: Path | str | None, offset: int = 0) -> bool:
    """Whether the log, from byte ``offset`` on, shows the Python backend's lock_exception abort."""
    if path is None:
        return False
    try:
        return any(_LOAD_ABORT in line for line in _read_lines(path, offset))
    except FileNotFoundError:
        return False


# lines after which a model never becomes ready: Triton 2.51 then keeps loading the rest and neither gets ready nor
# exits (a stub that failed to start, e.g. a repository rendered without its model.py files), so waiting longer is
# pointless; the line itself says why
_MODEL_FAILED = re.compile(r"Failed to preinitialize Python stub|failed to load '|Python model file not found|"
                           r"Stub process '.*' is not healthy|failed to initialize model")


def model_failures(path: Path | str | None, offset: int = 0, limit: int = 10) -> list[str]:
    """Lines saying a model cannot start, from byte ``offset`` of the log on (the first ``limit``)."""
    if path is None:
        return []
    found: list[str] = []
    try:
        for line in _read_lines(path, offset):
            if _MODEL_FAILED.search(line):
                found.append(line.strip())
                if len(found) >= limit:
                    break
    except FileNotFoundError:
        pass
    return found


_STUB_START_REGION = re.compile(rf"Starting Python backend stub:.*?\s({SHM_REGION_NAME}[\w.-]*)")


def logged_shm_regions(path: Path | str | None, offset: int = 0) -> list[str]:
    """Shared-memory region names from the log's ``Starting Python backend stub: exec ...`` lines (byte ``offset`` on).

    Triton logs those lines at ``--log-verbose=1`` and above only; at the default level this finds nothing and the
    regions come from /proc instead (see :mod:`.process`). It still catches a region whose stub started after the
    launcher last looked (a model loaded later in explicit mode) when the log is verbose.
    """
    if path is None:
        return []
    found: dict[str, None] = {}
    try:
        for line in _read_lines(path, offset):
            if "Starting Python backend stub" in line:
                match = _STUB_START_REGION.search(line)
                if match:
                    found[match.group(1)] = None
    except FileNotFoundError:
        pass
    return list(found)
