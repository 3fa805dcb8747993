"""What every worker process shares: its settings, the Dynamo runtime on file discovery, and its stats file.

Each worker writes `<run_dir>/workers/<role>-<index>.json` after every turn (routing counters written/read/applied,
hand-over bytes and times, turns served) and appends one line per turn to `<run_dir>/turns.jsonl`: that is what
`scripts/dynamo_up.py status`, the tests and docs/scale_out.md read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonserver_backend.auth.session_auth import INTERNAL_KEY_FILE
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.core.drafting import DRAFT_BATCH, DRAFTERS

NAMESPACE = "mol2"
MODEL_NAME = "mol2-small"
ENCODER_STEP, ENCODER_CONTROL = f"{NAMESPACE}.encoder.step", f"{NAMESPACE}.encoder.control"  # the decoders' calls
DECODER_TURN = f"{NAMESPACE}.decoder.turn"


@dataclass(frozen=True)
class WorkerSettings:
    role: str  # "encoder" | "decoder"
    index: int
    run_dir: Path
    model_dir: Path
    engine_dir: Path
    registry_root: Path
    backend: str = "onnx"
    max_context: int = 2048
    nixl_threshold: int = 0  # hand-overs of at least this many bytes move through NIXL; <= 0: all inline (transfer.py)
    record_logprobs: bool = False  # every turn computes its tokens' log-probabilities and turns.jsonl keeps them
    # a live session id's later turns need the token issued when it started (session_guard.py)
    session_auth: bool = True
    internal_key_file: Path | None = None  # the workers' shared secret; default <run_dir>/internal.key
    tensor_parallel_size: int = 1  # the worker leads a group of this many ranks (torch backend; docs/parallel.md)
    expert_parallel: bool = False  # routed experts placed whole over those ranks
    # speculative decoding in the decoder workers: the Triton path's switches (docs/speculative.md), same defaults
    speculative: str = "auto"
    speculative_block: int = 5
    speculative_confidence: float = 0.0
    speculative_batch: int = DRAFT_BATCH

    @property
    def internal_key_path(self) -> Path:
        """The internal key's file (session_auth.InternalKey.from_file creates it, 0600, when missing)."""
        return self.internal_key_file or self.run_dir / INTERNAL_KEY_FILE

    @classmethod
    def from_args(cls, role: str, argv: list[str] | None = None) -> "WorkerSettings":
        p = argparse.ArgumentParser(description=f"mol2 {role} worker on NVIDIA Dynamo")
        p.add_argument("--index", type=int, required=True)
        p.add_argument("--run-dir", type=Path, required=True)
        p.add_argument("--model-dir", type=Path, required=True)
        p.add_argument("--engine-dir", type=Path, required=True)
        p.add_argument("--registry-root", type=Path, required=True)
        p.add_argument("--backend", default="onnx", choices=["onnx", "torch"])
        p.add_argument("--max-context", type=int, default=2048)
        p.add_argument("--nixl-threshold-bytes", type=int, default=0,
                       help="hand-overs of at least this many bytes move through NIXL, smaller ones inline; 0 "
                            "(default) = NIXL off: its agent busy-polls a core per worker (docs/scale_out.md)")
        p.add_argument("--record-logprobs", action="store_true",
                       help="compute every token's log-probability and keep them in turns.jsonl (what the tests "
                            "compare bit for bit)")
        p.add_argument("--no-session-auth", dest="session_auth", action="store_false",
                       help="no session tokens: any client that sends a session id continues that conversation (a "
                            "trusted single-tenant deployment only; the workers' calls to each other stay signed)")
        p.add_argument("--internal-key-file", type=Path, default=None,
                       help="the secret the workers share (a 0600 file; created when missing); default "
                            "<run-dir>/internal.key")
        p.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="run this worker's role on N ranks, which the worker starts and leads (torch backend)")
        p.add_argument("--enable-expert-parallel", action="store_true",
                       help="place routed experts whole over the ranks")
        add_speculative_arguments(p)
        a = p.parse_args(argv)
        return cls(role, a.index, a.run_dir, a.model_dir, a.engine_dir, a.registry_root, a.backend, a.max_context,
                   a.nixl_threshold_bytes, a.record_logprobs, a.session_auth, a.internal_key_file,
                   a.tensor_parallel_size, a.enable_expert_parallel, a.speculative, a.speculative_block,
                   a.speculative_confidence, a.speculative_batch)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """The decoder workers' drafting switches (the Triton path's `speculative*` parameters, docs/speculative.md), for
    the worker and for `scripts/dynamo_up.py`."""
    p.add_argument("--speculative", default="auto", choices=DRAFTERS,
                   help="the decoder's drafter: auto runs the engines' DSpark drafter where they hold one, else none")
    p.add_argument("--speculative-block", type=int, default=5, help="most drafts per step (1..7)")
    p.add_argument("--speculative-confidence", type=float, default=0.0,
                   help="a DSpark block ends at its first draft below this confidence (0: never cut)")
    p.add_argument("--speculative-batch", type=int, default=DRAFT_BATCH,
                   help="a decoder step drafts only while at most this many turns are going")


# what Dynamo's DistributedRuntime accepts for each transport (its own documentation of the constructor)
RUNTIME_CHOICES = {"DYN_DISCOVERY_BACKEND": ("file", "etcd", "kubernetes", "mem"), "DYN_REQUEST_PLANE": ("tcp", "nats"),
                   "DYN_EVENT_PLANE": ("zmq", "nats")}
RUNTIME_DEFAULTS = {"DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq"}


def discovery_env(run_dir: Path) -> dict[str, str]:
    """Dynamo with no external services: discovery in files under the run folder, TCP requests, ZMQ events."""
    return {**RUNTIME_DEFAULTS, "DYN_FILE_KV": str(run_dir / "discovery"), "DYN_LOG": os.environ.get("DYN_LOG", "warn")}


def runtime_transports(env: dict[str, str] | None = None) -> tuple[str, str, str]:
    """(discovery backend, request plane, event plane) from the same DYN_* variables Dynamo's frontend reads, so one
    graph's environment (deploy/dynamo/graph.yaml) sets the workers and the frontend alike; unset, the loopback
    defaults (file discovery, TCP requests, ZMQ events: no etcd or NATS needed). An unknown value fails here, naming
    the variable, rather than deep inside the runtime."""
    env = dict(os.environ) if env is None else env
    values = []
    for name, default in RUNTIME_DEFAULTS.items():
        value = env.get(name, "") or default
        if value not in RUNTIME_CHOICES[name]:
            raise ValueError(f"{name}={value!r} is not one of {list(RUNTIME_CHOICES[name])}")
        values.append(value)
    return values[0], values[1], values[2]


def make_runtime(loop: asyncio.AbstractEventLoop):  # type: ignore[no-untyped-def]
    from dynamo.runtime import DistributedRuntime

    discovery, request_plane, event_plane = runtime_transports()
    return DistributedRuntime(loop, discovery, request_plane, event_plane=event_plane)


class WorkerStats:
    """Counters mirrored from the services plus transfer figures, flushed to the worker's JSON file."""

    def __init__(self, settings: WorkerSettings, counters: Counters) -> None:
        self.settings = settings
        self.counts: Counter[str] = Counter()  # "counter/adapter" -> n
        self.figures: Counter[str] = Counter()  # bytes, seconds, calls
        self.gauges: dict[str, float] = {}  # values now (sessions held), not totals
        self.instance_id: int | None = None
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()
        counters.listener = self._mirror
        (settings.run_dir / "workers").mkdir(parents=True, exist_ok=True)

    def _mirror(self, counter: str, adapter: str, amount: int) -> None:
        with self._lock:
            self.counts[f"{counter}/{adapter}"] += amount

    def add(self, **figures: float) -> None:
        with self._lock:
            for k, v in figures.items():
                self.figures[k] += v

    def set(self, **gauges: float) -> None:
        with self._lock:
            self.gauges.update(gauges)

    def flush(self) -> None:
        with self._lock:
            data = {"role": self.settings.role, "index": self.settings.index, "pid": os.getpid(),
                    "instance_id": self.instance_id, "counters": dict(self.counts), "figures": dict(self.figures),
                    "gauges": dict(self.gauges), "time": time.time()}
        path = self.settings.run_dir / "workers" / f"{self.settings.name}.json"
        tmp = path.with_suffix(".tmp")
        with self._file_lock:  # the event loop's thread and the decoder's scheduler thread both flush
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(path)

    def log_turn(self, **entry: Any) -> None:
        line = json.dumps({"worker": self.settings.name, "instance_id": self.instance_id, "time": time.time(), **entry})
        with open(self.settings.run_dir / "turns.jsonl", "a") as f:  # one short line per write: appends stay whole
            f.write(line + "\n")


def ready_file(settings: WorkerSettings) -> Path:
    return settings.run_dir / "workers" / f"{settings.name}.ready"


async def announce_ready(runtime, path: str, settings: WorkerSettings, instance_id: int) -> None:  # type: ignore[no-untyped-def]
    """Write the ready file once discovery lists this worker's endpoint (what other workers' clients will see)."""
    client = await runtime.endpoint(path).client()
    while instance_id not in client.instance_ids():
        await asyncio.sleep(0.1)
    ready_file(settings).write_text(str(instance_id))
