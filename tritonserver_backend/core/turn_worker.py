"""The one thread that owns the decoder model's requests, responses and metrics in Triton's Python backend, and runs
its scheduler.

Why one thread: `pb_utils` objects are not thread-safe inside one stub. A custom metric's `increment` rewrites the
metric's shared-memory record (`Metric::SendIncrementRequest` stores the value in the object, allocates a new
shared-memory block, releases the previous one, and sends the new handle to the server). Two threads incrementing
the same metric release a block the other thread's message still names; the stub then throws
`boost::interprocess::lock_exception` and the server reads a freed block (Signal 11 in `libtriton_python.so`).
The decoder used to run one thread per request, each reading inputs, calling the encoder through BLS, sending
responses and incrementing counters: two of four load runs killed the server (docs/load.md).

So `execute` only hands request objects to this thread and returns; the thread reads them, runs the scheduler
(one batched step for every active turn per iteration), sends every response and increments every metric. The one
exception is each step's BLS call to the encoder, which the scheduler runs on a thread of its own so that responses
stream meanwhile (`TurnScheduler._advance`): the BLS request and response objects are touched by that thread only,
one call at a time, which is the pattern the Python backend's own `async_exec` uses (it runs `exec` on an executor
thread while the model sends responses); no object is shared between the two threads.
It is Triton-free: reading requests is the `handle` callback, a step is the `iterate` callback.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

LOG = logging.getLogger("mol2")
_STOP = object()


class TurnWorker:
    """A queue of request batches and the one thread that takes them in (`handle`) and works (`iterate`)."""

    def __init__(self, handle: Callable[[list[Any]], None], iterate: Callable[[], None], idle: Callable[[], bool],
                 name: str = "mol2-decoder") -> None:
        self._handle, self._iterate, self._idle = handle, iterate, idle
        self._inbox: queue.Queue = queue.Queue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, requests: list[Any]) -> None:
        """Called by `execute` on the stub's main thread: no `pb_utils` call here, only a queue put."""
        self._inbox.put(list(requests))

    def _take(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=None)
            except queue.Empty:
                return
            if item is _STOP:
                self._stopping = True
                return
            self._handle(item)
            block = False

    def _run(self) -> None:
        while True:
            try:
                self._take(block=self._idle() and not self._stopping)
                if self._stopping and self._idle():
                    return
                self._iterate()
            except Exception:  # noqa: BLE001 - the scheduler answers its own turns; never let the thread die
                LOG.exception("decoder worker: unhandled error")

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the turns in flight, then end the thread (called from `finalize`)."""
        self._inbox.put(_STOP)
        self._thread.join(timeout=timeout)
