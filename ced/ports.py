"""Free TCP ports on the loopback address, for every process the project starts (tritonserver, the OpenAI frontend,
tensor-parallel rank groups).

Why a range: asking the kernel for port 0 and closing the socket leaves a window in which another process asking the
same way can be handed the same port; two test workers starting servers side by side do exactly that. When
`MOL2_PORT_RANGE` is set ("20000-25999"), ports come from that range instead, in turn from a per-process cursor, so
processes given disjoint ranges (the test workers: tests/conftest.py) never pick the same port, and one process never
hands out the same port twice until it has gone round its range (a process starts its round at an offset drawn from
its pid, so the processes a worker starts, which inherit its range, start elsewhere in it). Without it the kernel
picks (racy by nature, like any such pick, and fine for one server at a time)."""

from __future__ import annotations

import itertools
import os
import socket
import threading

RANGE_VARIABLE = "MOL2_PORT_RANGE"
HOST = "127.0.0.1"

_lock = threading.Lock()
_cursors: dict[tuple[int, int], itertools.cycle] = {}


def port_range(value: str | None = None) -> tuple[int, int] | None:
    """`MOL2_PORT_RANGE` (or `value`) as (first, last), both included; None when unset. A malformed one fails here,
    naming the variable, rather than binding wherever."""
    text = os.environ.get(RANGE_VARIABLE, "") if value is None else value
    if not text.strip():
        return None
    try:
        first, last = (int(part) for part in text.split("-"))
    except ValueError:
        raise ValueError(f"{RANGE_VARIABLE}={text!r}: expected FIRST-LAST, e.g. 20000-25999") from None
    if not 1024 <= first <= last <= 65535:
        raise ValueError(f"{RANGE_VARIABLE}={text!r}: expected 1024 <= FIRST <= LAST <= 65535")
    return first, last


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = HOST) -> int:
    """A TCP port free on `host` right now: the next bindable one of `MOL2_PORT_RANGE`, else the kernel's pick."""
    bounds = port_range()
    if bounds is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    first, last = bounds
    with _lock:
        if bounds not in _cursors:
            start = first + (os.getpid() * 7919) % (last - first + 1)
            _cursors[bounds] = itertools.cycle([*range(start, last + 1), *range(first, start)])
        cursor = _cursors[bounds]
        for _ in range(last - first + 1):
            port = next(cursor)
            if _bindable(host, port):
                return port
    raise OSError(f"no free port left in {RANGE_VARIABLE}={first}-{last}")
