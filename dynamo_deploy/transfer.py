"""How a hand-over crosses from the encoder worker to the decoder worker: inline below a size threshold, through NIXL
above it.

Measured in the deployment on loopback (docs/scale_out.md): inline costs ~4 ms per MB, a NIXL transfer ~12-15 ms
whatever its size up to 8.6 MB (Dynamo's connector adds the remote agent and polls for completion on every read); they
cross near 3-4 MB. Per-token rows and ordinary turns are far below that and stay inline; what crosses it is a
rebuild's hand-over of a long conversation (every position from 0), and any turn of the real model beyond a few tokens.
NIXL is off by default (threshold 0): a worker's NIXL agent runs a UCX progress thread that busy-polls one core from
start-up (measured: two idle workers, 2 cores busy), which on a small CPU host costs more than it saves. The producer
(the encoder) registers one contiguous buffer with `dynamo.nixl_connect.create_readable` and puts its RDMA metadata in
the turn request; the consumer (the decoder) reads it with `begin_read` before it admits the turn, so a turn never
starts on rows it has not fully received.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np

from dynamo_deploy.wire import Rows, nbytes, pack, unpack
from dynamo_deploy.worker_common import WorkerStats

LOG = logging.getLogger("mol2.transfer")
RECOMMENDED_NIXL_THRESHOLD = 4 << 20  # bytes, where NIXL is enabled; the measured crossover (docs/scale_out.md)
RELEASE_TIMEOUT_S = 120.0  # a readable nobody read (the decoder died before reading) is released after this
ALIGN = 64


def flatten(rows: Rows) -> tuple[np.ndarray, list[list[Any]]]:
    """Rows -> one contiguous byte buffer (what NIXL registers) and its layout [key, dtype, shape, offset]."""
    layout, offset = [], 0
    for key, a in rows.items():
        layout.append([key, a.dtype.str, list(a.shape), offset])
        offset += -(-a.nbytes // ALIGN) * ALIGN
    buf = np.zeros(max(offset, 1), np.uint8)
    for (key, _, _, off), a in zip(layout, rows.values()):
        buf[off:off + a.nbytes] = np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8)
    return buf, layout


def unflatten(buf: np.ndarray, layout: list[list[Any]]) -> Rows:
    out = {}
    for key, dtype, shape, off in layout:
        dt = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        out[key] = buf[off:off + size].view(dt).reshape(shape).copy()
    return out


class HandoverChannel:
    """One per worker. `threshold_bytes <= 0` turns NIXL off (everything inline; NIXL is not even imported)."""

    def __init__(self, threshold_bytes: int, stats: WorkerStats) -> None:
        self.threshold, self.stats = threshold_bytes, stats
        self._nc: Any = None
        self._connector: Any = None
        self._held: set[asyncio.Task] = set()

    @property
    def nixl(self) -> bool:
        return self.threshold > 0

    async def start(self) -> None:
        """Open the NIXL agent at start-up: a worker configured for NIXL that cannot load it fails loudly here,
        never falls back silently, and the first transfer does not pay the agent's set-up."""
        if not self.nixl:
            return
        import dynamo.nixl_connect as nc

        self._nc = nc
        self._connector = nc.Connector()
        warm = np.zeros(ALIGN, np.uint8)  # the agent is created on first use (~0.5 s): pay it here, not in a turn
        with await self._connector.create_readable(nc.Descriptor((warm, "cpu"))):
            pass

    # ------------------------------------------------------------------ producer (encoder)
    async def offer(self, rows: Rows) -> tuple[dict[str, Any], asyncio.Task | None]:
        """-> the wire form for the request, and (NIXL) the task that holds the registered buffer until the consumer
        has read it (cancel it to release early, e.g. when the consumer is gone)."""
        size = nbytes(rows)
        if not self.nixl or size < self.threshold:
            self.stats.add(sent_inline_bytes=size, sent_inline_transfers=1)
            return {"inline": pack(rows)}, None
        t0 = time.perf_counter()
        buf, layout = flatten(rows)
        readable = await self._connector.create_readable(self._nc.Descriptor((buf, "cpu")))
        wire = {"nixl": {"meta": readable.metadata().model_dump(), "layout": layout, "size": int(buf.size)}}
        self.stats.add(sent_nixl_bytes=size, sent_nixl_transfers=1, sent_nixl_register_s=time.perf_counter() - t0)
        task = asyncio.create_task(self._hold(readable, buf))
        self._held.add(task)
        task.add_done_callback(self._held.discard)
        return wire, task

    async def _hold(self, readable: Any, buf: np.ndarray) -> None:
        with readable:  # deregisters the buffer on exit
            try:
                await asyncio.wait_for(readable.wait_for_completion(), RELEASE_TIMEOUT_S)
            except TimeoutError:
                LOG.warning("a NIXL hand-over of %d B was not read within %.0f s; released", buf.size,
                            RELEASE_TIMEOUT_S)
        del buf

    # ------------------------------------------------------------------ consumer (decoder)
    async def take(self, wire: dict[str, Any]) -> tuple[Rows, str]:
        """The wire form -> rows, and which transport carried them ("inline" | "nixl")."""
        if "inline" in wire:
            rows = unpack(wire["inline"])
            self.stats.add(received_inline_bytes=nbytes(rows), received_inline_transfers=1)
            return rows, "inline"
        if not self.nixl:
            raise RuntimeError("a NIXL hand-over reached a worker started without NIXL (--nixl-threshold-bytes 0)")
        spec = wire["nixl"]
        t0 = time.perf_counter()
        buf = np.empty(int(spec["size"]), np.uint8)
        meta = self._nc.RdmaMetadata.model_validate(spec["meta"])
        with await self._connector.begin_read(meta, self._nc.Descriptor((buf, "cpu"))) as op:
            await op.wait_for_completion()
        rows = unflatten(buf, spec["layout"])
        self.stats.add(received_nixl_bytes=nbytes(rows), received_nixl_transfers=1,
                       received_nixl_read_s=time.perf_counter() - t0)
        return rows, "nixl"
