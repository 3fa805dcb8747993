"""Waiting on a condition instead of sleeping a fixed time.

Why: a fixed `sleep(3.0)` before "all three turns are in flight" is too long on an idle machine and can be too short
on a loaded one, where the test then checks the wrong state and fails (or, worse, passes) for the wrong reason.
Polling the condition itself with a deadline waits exactly as long as needed and, when the condition never comes,
fails naming what it waited for and the last value seen. `holds_for` is the other half: a condition that must stay
true for a bounded window (something must NOT happen), checked all through the window so a break fails at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `predicate` until it returns a truthy value and return that value; after `timeout` seconds fail with
    `what` (the condition in words) and the last value the predicate returned."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last seen: {value!r})")
        time.sleep(interval)


def holds_for(predicate: Callable[[], object], seconds: float, what: str, interval: float = 0.05) -> None:
    """Check that `predicate` stays truthy for `seconds`, polling every `interval`; fail at the first poll where it
    does not, naming `what` (the condition that must hold) and how far into the window it broke."""
    started = time.monotonic()
    while True:
        value = predicate()
        elapsed = time.monotonic() - started
        if not value:
            raise AssertionError(f"{what}: broke {elapsed:.2f} s into the {seconds:g} s window (got {value!r})")
        if elapsed >= seconds:
            return
        time.sleep(interval)
