"""One thread that owns every call into Triton's Python backend for the decoder model.

Why: `pb_utils` objects are not thread-safe inside one stub. A custom metric's `increment` rewrites the metric's
shared-memory record (`Metric::SendIncrementRequest` stores the value in the object, allocates a new shared-memory
block, releases the previous one, and sends the new handle to the server). Two threads incrementing the same
metric release a block the other thread's message still names; the stub then throws
`boost::interprocess::lock_exception` and the server reads a freed block (Signal 11 in `libtriton_python.so`).
The decoder used to run one thread per request, each reading inputs, calling the encoder through BLS, sending
responses and incrementing counters: two of four load runs killed the server (docs/load.md).

So `execute` only hands request objects to this worker and returns; the worker reads them, runs them, talks BLS,
sends every response and increments every metric. Nothing else in the stub touches `pb_utils` after
`initialize`. The worker is Triton-free: what it does with a request is the `handle` callback it is given.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

LOG = logging.getLogger("mol2")
_STOP = object()


class TurnWorker:
    """A queue of request objects and the one thread that serves them (`handle(request)` per request)."""

    def __init__(self, handle: Callable[[Any], None], name: str = "mol2-decoder") -> None:
        self._handle = handle
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, requests: list[Any]) -> None:
        """Called by `execute` on the stub's main thread: no `pb_utils` call here, only a queue put."""
        for request in requests:
            self._inbox.put(request)

    def _run(self) -> None:
        while True:
            request = self._inbox.get()
            if request is _STOP:
                return
            try:
                self._handle(request)
            except Exception:  # noqa: BLE001 - `handle` answers its own request; never let the worker die
                LOG.exception("decoder worker: unhandled error")

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what was submitted, then end the thread (called from `finalize`)."""
        self._inbox.put(_STOP)
        self._thread.join(timeout=timeout)
