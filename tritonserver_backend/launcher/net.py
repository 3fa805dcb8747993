"""Loopback addresses: the one host the server listens on, free ports, the readiness probe, the repository index."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from ced.ports import HOST, free_port

__all__ = ["HOST", "free_port", "http_ready", "repository_index"]


def http_ready(http_port: int, host: str = HOST, timeout: float = 1.0) -> bool:
    """Whether ``GET /v2/health/ready`` answers 200."""
    try:
        with urllib.request.urlopen(f"http://{host}:{http_port}/v2/health/ready", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def repository_index(http_port: int, host: str = HOST, timeout: float = 2.0) -> list[dict[str, Any]] | None:
    """Triton's ``POST /v2/repository/index``: one entry per model (``name``, and once it was asked to load,
    ``version``, ``state`` such as READY / LOADING / UNLOADING / UNAVAILABLE, ``reason`` such as "unloaded"); None
    when the server does not answer it."""
    request = urllib.request.Request(f"http://{host}:{http_port}/v2/repository/index", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            data = json.loads(resp.read())
    except (urllib.error.URLError, ConnectionError, OSError, ValueError):
        return None
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else None
