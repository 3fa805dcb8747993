"""One helper for the load scripts: run N client functions on threads that start together, and time them."""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def run_together(count: int, client: Callable[[int], T], what: str) -> tuple[float, dict[int, T]]:
    """Start `client(0..count-1)` on threads released at once by a barrier -> (wall seconds from the release to the
    last one's end, results by index). Any client's exception fails the run with the first few messages: a load
    figure with failed clients in it would not mean what it says."""
    results: dict[int, T] = {}
    errors: list[str] = []
    barrier = threading.Barrier(count + 1)

    def body(i: int) -> None:
        barrier.wait()
        try:
            results[i] = client(i)
        except Exception as exc:  # noqa: BLE001
            errors.append(str(exc))

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{what}: {len(errors)} of {count} clients failed: {errors[:3]}")
    return wall, results
