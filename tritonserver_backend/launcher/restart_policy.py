"""When to start a dead server again, and when to stop trying (the supervisor's back-off).

Why a back-off at all: a stub that dies because of the request it serves (an OOM on a long prompt, a segfault in a
kernel) may die again at once when the client retries; restarting in a tight loop would burn CPU, flood the log and
never be ready for long. Why a give-up: a server that keeps dying (a broken model, a node out of memory) is better
reported as dead, so an orchestrator replaces the pod, than hidden behind endless restarts.
"""

from __future__ import annotations

import dataclasses
import time

DEFAULT_DELAYS: tuple[float, ...] = (0.0, 2.0, 5.0, 10.0, 20.0)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do about one fault: wait ``delay`` s and restart, or give up (then ``reason`` says why)."""

    restart: bool
    delay: float
    count: int  # faults in the window, this one included
    reason: str | None = None


@dataclasses.dataclass
class RestartPolicy:
    """Back-off by the number of faults in the last ``window_s`` seconds; give up past ``max_restarts`` of them.

    The n-th fault in the window waits ``delays[n-1]`` (the last delay repeats). Faults older than the window are
    forgotten, so a fault after a long quiet period starts the count (and the back-off) afresh."""

    max_restarts: int = 5
    window_s: float = 600.0
    delays: tuple[float, ...] = DEFAULT_DELAYS
    fault_times: list[float] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"restart window must be > 0 s, got {self.window_s}")
        if not self.delays:
            self.delays = (0.0,)

    def recent(self, now: float | None = None) -> list[float]:
        """The fault times still inside the window at ``now``."""
        now = time.monotonic() if now is None else now
        return [t for t in self.fault_times if now - t <= self.window_s]

    def on_fault(self, now: float | None = None) -> Decision:
        """Count a fault at ``now`` (monotonic seconds) and say what to do."""
        now = time.monotonic() if now is None else now
        self.fault_times = [*self.recent(now), now]
        count = len(self.fault_times)
        if count > self.max_restarts:
            return Decision(restart=False, delay=0.0, count=count,
                            reason=f"{count} faults within {self.window_s:g} s (max_restarts {self.max_restarts})")
        return Decision(restart=True, delay=float(self.delays[min(count, len(self.delays)) - 1]), count=count)
