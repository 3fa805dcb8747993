"""The supervisor's own health endpoints, for orchestrators and load balancers (stdlib HTTP, JSON bodies).

Why not Triton's ``/v2/health/ready``: after a Python-backend stub dies Triton keeps answering 200 there although it
will never serve again (server issues 7862/8604). These endpoints combine the supervisor's state with Triton's:

* ``GET /health/live``  200 unless the supervisor gave up (then 503: replace me);
* ``GET /health/ready`` 200 only when the state is ``ready`` and Triton's own ready endpoint answers 200 right now;
* ``GET /health``       200 with the status JSON. The whole status (PIDs, ports, paths, log files, every fault with
  its detail) goes to a loopback peer, or to a peer that sends the operator key; any other peer gets the public view
  (:func:`public_status`: state, live, ready, restarts, fault count, give-up flag), because in a container the probe
  listens on every interface and the pod network must not learn the server's layout from it.

The operator key is the adapter_admin key (:mod:`tritonserver_backend.auth.admin_auth`, docs/admin.md), sent as it is
sent to Triton, in the ``mol2-admin-key`` header, or as ``Authorization: Bearer <key>``; it is compared in constant
time. A key that does not match gets 403 (no status at all), so an operator learns that the key is wrong instead of
silently reading the public view.

Why the connection limits (:class:`HealthProbe`): the probe port is reachable from the pod network, and the stdlib's
threaded server gives every connection a thread that waits for the request for ever. Here a connection gets
``read_timeout`` seconds per read and ``request_deadline`` seconds in all (a client dripping one byte at a time cannot
keep it), and at most ``max_threads`` connections are served at once; one more is answered 503 at once and closed,
from the accepting thread, which never waits on a client.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
import threading
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from tritonserver_backend.auth.admin_auth import ADMIN_KEY_HEADER, keys_match
from tritonserver_backend.launcher.net import HOST

READY, GAVE_UP = "ready", "gave_up"
FULL, PUBLIC, REFUSED = "full", "public", "refused"
MAX_THREADS = 16  # probes come every few seconds: 16 at once is far more than any orchestrator sends
READ_TIMEOUT_S = 5.0  # per read: the kubelet's probe sends its request at once
REQUEST_DEADLINE_S = 10.0  # per connection, whatever the client sends meanwhile
_BUSY_BODY = json.dumps({"error": "health probe busy: too many open connections; try again"}).encode()
BUSY_RESPONSE = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


def peer_is_loopback(host: str) -> bool:
    """Whether a peer address (``client_address[0]``) is loopback: 127.0.0.0/8, ``::1``, or an IPv4-mapped IPv6
    loopback (``::ffff:127.0.0.1``, what a dual-stack socket reports). Anything unparsable is not loopback."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def presented_keys(headers: Message) -> list[str]:
    """The operator keys a request carries: each ``mol2-admin-key`` header and each ``Authorization: Bearer`` one."""
    keys = [value.strip() for value in headers.get_all(ADMIN_KEY_HEADER) or []]
    for value in headers.get_all("Authorization") or []:
        scheme, _, credentials = value.strip().partition(" ")
        if scheme.lower() == "bearer":
            keys.append(credentials.strip())
    return keys


def view_for(peer: str, keys: list[str], expected: Callable[[], str | None] | None) -> str:
    """Which ``/health`` a request gets: FULL from loopback or with the operator key, PUBLIC from elsewhere without a
    key, REFUSED with a key that does not match (or when this supervisor has no key to match). ``expected`` is only
    asked when a remote request carries a key (it may read a file)."""
    if peer_is_loopback(peer):
        return FULL
    if not keys:
        return PUBLIC
    key = expected() if expected is not None else None
    if key and all(keys_match(k, key) for k in keys):
        return FULL
    return REFUSED


def public_status(status: dict[str, Any], triton_ready: Callable[[], bool]) -> dict[str, Any]:
    """What ``/health`` tells a peer that is neither local nor holds the key: whether to send traffic and how the
    server has fared, and nothing that names a process, a file, a port or a log line."""
    state = status.get("state")
    faults = status.get("faults_total")
    return {
        "state": state,
        "live": state != GAVE_UP,
        "ready": state == READY and bool(triton_ready()),
        "restarts": status.get("restarts", 0),
        "faults_total": faults if isinstance(faults, int) else len(status.get("faults") or []),
        "gave_up": state == GAVE_UP,
        "view": PUBLIC,
        "full_status": f"from loopback, or with the operator key in the {ADMIN_KEY_HEADER!r} header "
                       "(docs/reliability.md)",
    }


def answer(path: str, status: dict[str, Any], triton_ready: Callable[[], bool], *,
           full: bool = False) -> tuple[int, dict[str, Any]]:
    """The HTTP code and JSON body for ``GET path`` given the supervisor's ``status`` (its ``state`` key decides);
    ``triton_ready`` is asked only when the state is ready (it makes a request). ``full``: ``/health`` answers the
    whole status (a local or keyed request); otherwise the :func:`public_status`. The default is the safe one."""
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
        return 200, (status if full else public_status(status, triton_ready))
    return 404, {"error": f"no such endpoint {path[:200]!r}; try /health, /health/live, /health/ready"}


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server that serves at most ``max_threads`` connections at once; one more gets
    :data:`BUSY_RESPONSE` straight from the accepting thread (never blocking it) and is closed."""

    daemon_threads = True
    request_queue_size = 64  # the listen backlog: a burst of probes waits in the kernel, not refused

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_threads: int) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        self.max_threads = max_threads
        self._slots = threading.BoundedSemaphore(max_threads)
        self.refused = 0  # connections answered busy (tests and logs read it)
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET  # "::" listens on IPv6 too
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self._answer_busy(request)
            return
        try:
            super().process_request(request, client_address)  # starts the thread that serves it
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet about clients that went away or were cut at the deadline (the stdlib prints a traceback for each);
        anything else is still printed."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def _answer_busy(self, request: socket.socket) -> None:
        try:
            request.settimeout(0)  # a full send buffer must not stall the accepting thread
            request.sendall(BUSY_RESPONSE)
            request.recv(65536)  # what the client sent already: unread data would turn the close into a reset
        except OSError:
            pass
        finally:
            self.shutdown_request(request)


class HealthProbe:
    """A small threaded HTTP server answering :func:`answer` on ``host:port`` (port 0: a free one, see ``port``).

    ``operator_key`` returns the key that unlocks the full ``/health`` for a remote peer (None: no key, so only
    loopback peers see it); ``max_threads``, ``read_timeout`` and ``request_deadline`` bound what clients can hold
    (see the module docstring; tests pass small values to see them act quickly)."""

    def __init__(self, status: Callable[[], dict[str, Any]], triton_ready: Callable[[], bool], port: int = 0,
                 host: str = HOST, operator_key: Callable[[], str | None] | None = None,
                 max_threads: int = MAX_THREADS, read_timeout: float = READ_TIMEOUT_S,
                 request_deadline: float = REQUEST_DEADLINE_S) -> None:
        probe = self

        class Handler(BaseHTTPRequestHandler):
            timeout = read_timeout  # StreamRequestHandler sets it on the socket: each read waits at most this long

            def setup(self) -> None:
                super().setup()
                # the read timeout alone lets a client that drips a byte per read keep the thread for ever
                self._deadline = threading.Timer(request_deadline, self._cut)
                self._deadline.daemon = True
                self._deadline.start()

            def _cut(self) -> None:
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def finish(self) -> None:
                self._deadline.cancel()
                try:
                    super().finish()
                except OSError:  # the deadline shut the socket while the answer was flushed
                    pass

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                try:
                    view = PUBLIC  # /health/live and /health/ready: the same for every peer, key or not
                    if self.path.split("?", 1)[0].rstrip("/") == "/health":
                        view = view_for(str(self.client_address[0]), presented_keys(self.headers), probe.operator_key)
                    if view == REFUSED:
                        code, body = 403, {"error": "operator key not accepted; /health/live and /health/ready "
                                                    "need none"}
                    else:
                        code, body = answer(self.path, probe.status(), probe.triton_ready, full=view == FULL)
                except Exception as exc:  # never let a probe hang or drop the connection without an answer
                    code, body = 500, {"error": f"{type(exc).__name__}"}
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
        self.operator_key = operator_key
        self.httpd = BoundedHTTPServer((host, port), Handler, max_threads)
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
