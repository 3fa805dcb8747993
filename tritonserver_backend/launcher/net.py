"""Loopback addresses: the one host the server listens on, free ports, and the readiness probe."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port that is free on the loopback address right now (the kernel's pick; racy by nature, like any such)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_ready(http_port: int, host: str = HOST, timeout: float = 1.0) -> bool:
    """Whether ``GET /v2/health/ready`` answers 200."""
    try:
        with urllib.request.urlopen(f"http://{host}:{http_port}/v2/health/ready", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False
