"""The decoder scheduler's encoder port over Dynamo: per-token steps and clean-up calls go to the encoder worker that
holds each session (`Client.direct` by instance id), from the scheduler's thread into the worker's event loop.

The scheduler batches every active turn into one step; their sessions may live on different encoder workers, so a
step is split by encoder instance and the calls run concurrently. Every call is signed with the deployment's internal
key (session_guard.CallAuth): the encoder takes steps and clean-up calls from its decoders only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from dynamo_deploy.session_guard import CallAuth
from dynamo_deploy.wire import nbytes, unpack
from dynamo_deploy.worker_common import ENCODER_CONTROL, ENCODER_STEP, WorkerStats
from tritonserver_backend.core.handover import Handover
from tritonserver_backend.errors import ServingError

CALL_TIMEOUT_S = 120.0


class RemoteEncoderPort:
    def __init__(self, step_client: Any, control_client: Any, loop: asyncio.AbstractEventLoop, stats: WorkerStats,
                 calls: CallAuth) -> None:
        self.step_client, self.control_client, self.loop, self.stats = step_client, control_client, loop, stats
        self.calls = calls
        self.encoder_of: dict[str, int] = {}  # session id -> the encoder instance that holds it (set by each turn)

    def step(self, session_ids: list[str], tokens: np.ndarray, turn_done: bool, keep: np.ndarray | None = None,
             draft: bool = False) -> list[Handover]:
        """`keep` (each session's kept length of its previous speculative step, -1: none) and `draft` (this step's
        rows are not absorbed until the next call says how many to keep) travel with the step, so the accepted
        length costs no round trip of its own (encoder_service.encode_step)."""
        groups: dict[int, list[int]] = {}
        for b, sid in enumerate(session_ids):
            groups.setdefault(self._encoder(sid), []).append(b)

        async def all_groups() -> list[list[Handover]]:
            return await asyncio.gather(*[self._step(inst, [session_ids[b] for b in rows], tokens[rows], turn_done,
                                                     None if keep is None else np.asarray(keep)[rows], draft)
                                          for inst, rows in groups.items()])

        results = asyncio.run_coroutine_threadsafe(all_groups(), self.loop).result(CALL_TIMEOUT_S)
        out: list[Handover | None] = [None] * len(session_ids)
        for (_, rows), handovers in zip(groups.items(), results):
            for b, h in zip(rows, handovers):
                out[b] = h
        return out  # type: ignore[return-value]

    async def _step(self, instance: int, sessions: list[str], tokens: np.ndarray, turn_done: bool,
                    keep: np.ndarray | None, draft: bool) -> list[Handover]:
        t0 = time.perf_counter()
        body: dict[str, Any] = {"sessions": sessions, "tokens": tokens.tolist(), "turn_done": turn_done}
        if keep is not None or draft:
            body.update(keep=None if keep is None else [int(v) for v in keep], draft=draft)
        stream = await self.step_client.direct(self.calls.sign(ENCODER_STEP, body), instance)
        data: dict[str, Any] | None = None
        async for chunk in stream:
            data = chunk.data()
        if data is None:
            raise ServingError(f"encoder instance {instance} returned nothing for a step")
        if "error" in data:
            raise ServingError(data["error"])
        rows = [unpack(r) for r in data["rows"]]
        self.stats.add(step_calls=1, step_rows=sum(int(r["positions"].size) for r in rows),
                       step_bytes=sum(nbytes(r) for r in rows), step_rtt_s=time.perf_counter() - t0,
                       step_encoder_compute_s=float(data.get("compute_s", 0.0)))
        return rows

    def _encoder(self, session_id: str) -> int:
        if session_id not in self.encoder_of:
            raise ServingError(f"no encoder worker is known for session {session_id!r}")
        return self.encoder_of[session_id]

    def _control(self, op: str, session_id: str) -> None:
        async def call() -> None:
            body = self.calls.sign(ENCODER_CONTROL, {"op": op, "session_id": session_id})
            stream = await self.control_client.direct(body, self._encoder(session_id))
            async for chunk in stream:
                if "error" in (data := chunk.data()):
                    raise ServingError(data["error"])

        asyncio.run_coroutine_threadsafe(call(), self.loop).result(CALL_TIMEOUT_S)

    def rollback(self, session_id: str) -> None:
        self._control("rollback", session_id)

    def drop(self, session_id: str) -> None:
        self._control("end", session_id)
