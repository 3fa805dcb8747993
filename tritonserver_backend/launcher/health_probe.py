"""The supervisor's own health endpoints, for orchestrators and load balancers (stdlib HTTP, JSON bodies).

Why not Triton's ``/v2/health/ready``: after a Python-backend stub dies Triton keeps answering 200 there although it
will never serve again (server issues 7862/8604). These endpoints combine the supervisor's state with Triton's:

* ``GET /health/live``  200 unless the supervisor gave up (then 503: replace me);
* ``GET /health/ready`` 200 only when the state is ``ready`` and Triton's own ready endpoint answers 200 right now;
* ``GET /health``       200 with the whole status JSON (state, pids, ports, restarts, faults, give-up reason).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from tritonserver_backend.launcher.net import HOST

READY, GAVE_UP = "ready", "gave_up"


def answer(path: str, status: dict[str, Any], triton_ready: Callable[[], bool]) -> tuple[int, dict[str, Any]]:
    """The HTTP code and JSON body for ``GET path`` given the supervisor's ``status`` (its ``state`` key decides);
    ``triton_ready`` is asked only when the state is ready (it makes a request)."""
    state = status.get("state")
    path = path.split("?", 1)[0].rstrip("/") or "/"
    if path == "/health/live":
        live = state != GAVE_UP
        return (200 if live else 503), {"live": live, "state": state, "reason": status.get("give_up_reason")}
    if path == "/health/ready":
        if state != READY:
            return 503, {"ready": False, "state": state}
        if not triton_ready():
            return 503, {"ready": False, "state": state, "reason": "tritonserver /v2/health/ready is not 200"}
        return 200, {"ready": True, "state": state}
    if path == "/health":
        return 200, status
    return 404, {"error": f"no such endpoint {path!r}; try /health, /health/live, /health/ready"}


class HealthProbe:
    """A small threaded HTTP server answering :func:`answer` on ``host:port`` (port 0: a free one, see ``port``)."""

    def __init__(self, status: Callable[[], dict[str, Any]], triton_ready: Callable[[], bool], port: int = 0,
                 host: str = HOST) -> None:
        probe = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                try:
                    code, body = answer(self.path, probe.status(), probe.triton_ready)
                except Exception as exc:  # never let a probe hang or drop the connection without an answer
                    code, body = 500, {"error": f"{type(exc).__name__}: {exc}"}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:  # probes every few seconds would flood the log
                pass

        self.status = status
        self.triton_ready = triton_ready
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host = host
        self.port: int = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "HealthProbe":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="health-probe", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.httpd.server_close()
