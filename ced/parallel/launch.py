"""Run a function on N local ranks (one spawned process each, a gloo process group) and collect what each returns.

Why a launcher of our own instead of `torch.multiprocessing.spawn`: a tensor-parallel rank that dies leaves its peers
blocked inside a collective, and `spawn` joins its children one by one, so the parent can wait on a live, blocked rank
while the dead one is never looked at. Here the parent polls every child: the first one that exits without a result
(a crash, `os._exit`, the OOM killer) or that reports an exception makes the parent kill all the others and raise
`RankFailed` naming the rank, its exit code or signal, and its traceback. The process group itself has a timeout too,
so a rank blocked on a peer that never arrives errors out by itself, and the whole run has a deadline.

Results travel back pickled to bytes through a queue (plain pickling: tensors are copied, nothing is left in shared
memory that a dead child would own).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

from ced.ports import free_port

#: How long a collective may wait for a peer before the process group gives up (seconds).
DEFAULT_GROUP_TIMEOUT_S = 60.0
#: Deadline of a whole `run_ranks` call (seconds).
DEFAULT_RUN_TIMEOUT_S = 300.0


class RankFailed(RuntimeError):
    """A rank crashed, raised, or the run passed its deadline; the other ranks were killed."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, results: Any,
               group_timeout_s: float, threads: int) -> None:
    """Child process body: join the group, run `fn(rank, world, *args)`, send ("ok" | "error", rank, payload)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=group_timeout_s))
        value = fn(rank, world, *args)
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException:  # everything, KeyboardInterrupt included, goes back to the parent
        results.put(("error", rank, traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer may be gone already; the result is what matters
                pass
    results.close()
    results.join_thread()  # the payload is flushed to the pipe before the exit
    os._exit(code)  # skip interpreter teardown (atexit of torch/gloo threads)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_ranks(fn: Callable[..., Any], world: int, args: Sequence[Any] = (), timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
              group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S, threads: int = 1) -> list[Any]:
    """`fn(rank, world, *args)` on `world` fresh processes in one gloo group; returns their results in rank order.

    `fn` and `args` must be picklable (a module-level function). Raises `RankFailed` as soon as any rank raises or
    dies, or when `timeout_s` passes, after killing every remaining rank, so a caller never hangs on a lost peer.
    """
    if world < 1:
        raise ValueError(f"world={world} must be at least 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, tuple(args), results, group_timeout_s, threads),
                         name=f"rank-{r}", daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world:
            try:
                kind, rank, payload = results.get(timeout=0.05)
            except queue_module.Empty:
                kind = None
            if kind == "error":
                errors[rank] = payload
            elif kind == "ok":
                done[rank] = pickle.loads(payload)
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done and r not in errors]
            if errors or dead:
                _raise_failure(procs, results, done, errors)
            if time.monotonic() > deadline:
                waiting = [r for r in range(world) if r not in done]
                raise RankFailed(f"ranks {waiting} of {world} returned nothing within {timeout_s:g} s; all were killed")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [done[r] for r in range(world)]
    finally:
        _kill_all(procs)
        results.close()


def _raise_failure(procs: list, results: Any, done: dict[int, Any], errors: dict[int, str]) -> None:
    """Name the root cause: a rank that died without a word comes first (its peers' errors, typically a closed
    connection inside a collective, are its consequence); otherwise the first rank that raised.

    A rank seen dead may still have its last message in the pipe, and a peer's error often arrives a moment before the
    death is visible, so the queue is drained for a short grace period before deciding. Returns (nothing failed)
    when the rank seen exiting had just sent its result.
    """
    grace = time.monotonic() + 1.0
    while time.monotonic() < grace:
        try:
            kind, rank, payload = results.get(timeout=0.05)
        except queue_module.Empty:
            continue
        if kind == "error":
            errors[rank] = payload
        else:
            done[rank] = pickle.loads(payload)
    world = len(procs)
    dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done and r not in errors]
    if dead:
        r = dead[0]
        code = procs[r].exitcode
        also = "".join(f"\nrank {e} then failed: {tb.strip().splitlines()[-1]}" for e, tb in sorted(errors.items()))
        raise RankFailed(f"rank {r} of {world} died ({_describe_exit(code)}) before returning a result; the other "
                         f"ranks were killed{also}", rank=r, exitcode=code)
    if not errors:
        return
    r = min(errors)
    raise RankFailed(f"rank {r} of {world} raised:\n{errors[r]}", rank=r)


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5.0)
