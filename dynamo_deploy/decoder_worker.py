"""The decoder component: decoder engine, adapter bank, bounded replay and the token loop (in-flight batching).

Endpoint `mol2.decoder.turn`: one turn per request (session id, hand-over rows, ADAPTER_HASH, sampling, the encoder
instance that holds the session), answered as a stream of tokens. The project's `TurnScheduler` runs the token loops
of all active turns on one thread, calling the session's encoder worker once per generated token
(`RemoteEncoderPort`); the Dynamo handlers only queue turns and relay what the scheduler emits.

A turn is taken only under the encoder's grant (session_guard.py): an HMAC under the deployment's internal key of the
session id and the hand-over's first position, fresh, and newer than the session's last grant (each is taken once).
Anything else on the request plane is refused before its rows are read, so it can neither overwrite a session's
decoder state nor start a turn that steps the session's encoder. The port signs its step and control calls.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ced.text.tokenizer import ChatTokenizer
from dynamo_deploy.remote_encoder import RemoteEncoderPort
from dynamo_deploy.requests import params_from_json
from dynamo_deploy.session_guard import PATH_HANDOVER, CallAuth, load_internal_key
from dynamo_deploy.transfer import HandoverChannel
from dynamo_deploy.wire import nbytes
from dynamo_deploy.worker_common import (
    DECODER_TURN,
    ENCODER_CONTROL,
    ENCODER_STEP,
    WorkerSettings,
    WorkerStats,
    announce_ready,
    make_runtime,
)
from tritonserver_backend.adapters.registry import Registry
from tritonserver_backend.auth.session_auth import GrantLedger, SessionRefused, first_position, grant_subject, refusal
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.core.decoder_service import DecoderService, Turn
from tritonserver_backend.core.drafting import make_drafter
from tritonserver_backend.core.scheduler import DEFAULT_REPLAY_BUDGET, TurnScheduler, TurnStart
from tritonserver_backend.engines import open_engine

LOG = logging.getLogger("mol2.decoder")


@dataclass
class Sink:
    """Where the scheduler's thread puts one turn's tokens for its Dynamo handler."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    closed: bool = False

    def put(self, item: tuple[str, Any, Any, Any]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class DecoderWorker:
    def __init__(self, settings: WorkerSettings, step_client: Any, control_client: Any,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.settings, self.loop = settings, loop
        self.counters = Counters()
        self.stats = WorkerStats(settings, self.counters)
        engine = open_engine(settings.backend, settings.model_dir, settings.engine_dir, settings.tensor_parallel_size,
                             settings.expert_parallel)
        tokenizer = ChatTokenizer.load(settings.model_dir)
        self.decoder = DecoderService(engine, Registry(settings.registry_root), tokenizer, self.counters,
                                      max_context=settings.max_context)
        self.key = load_internal_key(settings.internal_key_path)
        self.ledger = GrantLedger()
        self.port = RemoteEncoderPort(step_client, control_client, loop, self.stats, CallAuth(self.key))
        self.channel = HandoverChannel(settings.nixl_threshold, self.stats)
        # the Triton path's drafting (docs/speculative.md): each speculative step's kept length rides to the session's
        # encoder worker on its next step call, which absorbs only that much (remote_encoder.py)
        self.drafter = make_drafter(settings.speculative, settings.speculative_block, engine,
                                    settings.speculative_confidence)
        self.scheduler = TurnScheduler(self.decoder, self.port, self._emit, self._fail, drafter=self.drafter,
                                       draft_batch=settings.speculative_batch, replay_budget=DEFAULT_REPLAY_BUDGET)
        self.inbox: queue.SimpleQueue[TurnStart] = queue.SimpleQueue()
        self.wake = threading.Event()
        threading.Thread(target=self._loop, name="decoder-scheduler", daemon=True).start()

    def _loop(self) -> None:
        """The scheduler's only thread: admit queued turns, one token for every active turn per iteration."""
        stored = -1
        while True:
            while not self.inbox.empty():
                self.scheduler.submit(self.inbox.get())
            if len(self.decoder.sessions) != stored:  # the sessions this worker holds, for `status` and the tests
                stored = len(self.decoder.sessions)
                self.stats.set(stored_sessions=stored)
                try:
                    self.stats.flush()
                except OSError:  # a full or vanished run folder must not stop the scheduler
                    LOG.exception("decoder: writing the stats failed")
            if self.scheduler.idle:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                self.scheduler.iterate()
            except Exception:  # noqa: BLE001 - keep serving the other sessions
                LOG.exception("decoder: scheduler iteration failed")

    def _emit(self, turn: Turn, token: int, reason: str) -> bool:
        sink: Sink = turn.context  # type: ignore[assignment]
        sink.put(("token", token, reason, turn.logprobs[-1] if token >= 0 and turn.params.logprobs else None))
        return not sink.closed

    def _fail(self, request: TurnStart | Turn, exc: BaseException) -> None:
        sink: Sink = request.context  # type: ignore[assignment]
        sink.put(("error", f"{type(exc).__name__}: {exc}", None, None))

    def _admit(self, sid: str, request: dict[str, Any]) -> int:
        """The hand-over's first position, when the request carries this deployment's grant for it (taken now, once);
        else SessionRefused, counted, before anything is read or changed. A fork's grant also names its source
        (`grant_subject`), so a grant for one fork cannot copy another session's decoder state."""
        try:
            first = int(request["first_position"])
            grant = request.get("grant")
            subject = grant_subject(sid, str(request["fork_from"]) if request.get("fork_from") else None)
            self.ledger.take(sid, self.key.verify(grant if isinstance(grant, str) else None, subject, first))
            return first
        except (SessionRefused, KeyError, TypeError, ValueError):
            self.counters.add(k.TOKEN_REFUSALS, PATH_HANDOVER)  # what was presented is never logged
            self.stats.flush()
            raise refusal(sid) from None

    async def turn(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        sid = str(request.get("session_id"))
        try:
            first = self._admit(sid, request)
        except SessionRefused as exc:
            yield {"error": str(exc)}
            return
        rows, _ = await self.channel.take(request["handover"])  # NIXL: read in full before the turn is admitted
        fork_from = str(request.get("fork_from") or "")
        if (not rows["positions"].size and not fork_from) or first_position(rows["positions"]) != first:
            yield {"error": f"the hand-over of session {sid!r} does not start at its granted position {first}"}
            return
        self.stats.add(handover_turns=1, handover_turn_bytes=nbytes(rows),
                       handover_turn_rows=int(rows["positions"].size),
                       handover_turn_transfer_s=time.time() - float(request["sent_at"]))
        self.port.encoder_of[sid] = int(request["encoder"])
        sink = Sink(asyncio.get_running_loop())
        # a fork (n > 1 choices) starts as a copy of its source's decoder state and ends with its turn
        self.inbox.put(TurnStart(sid, rows, int(request["adapter_hash"]), params_from_json(request["params"]),
                                 bool(request.get("end_session", False)), sink, fork_from,
                                 end_source=bool(fork_from and request.get("end_source", False))))
        self.wake.set()
        generated = 0
        watcher = asyncio.ensure_future(self._stop_when_told(context, sink))
        try:
            while True:
                kind, a, b, logprob = await sink.queue.get()
                if kind == "error":
                    yield {"error": a}
                    return
                if a >= 0:
                    generated += 1
                    if logprob is None:
                        yield {"token": int(a)}
                    else:
                        yield {"token": int(a), "logprob": logprob.logprob,
                               "top": [[i, v] for i, v in zip(logprob.top_ids, logprob.top_logprobs)]}
                if b:
                    self.stats.add(turns=1, generated_tokens=generated)
                    self.stats.flush()
                    yield {"finish": b}
                    return
        finally:
            watcher.cancel()
            sink.closed = True

    @staticmethod
    async def _stop_when_told(context: Any, sink: Sink) -> None:
        """Dynamo's cancellation: when the caller (the session's encoder, for a client that left) stops the request's
        context, the scheduler's next emit fails and the turn ends as "cancelled" at its next iteration, its partial
        reply kept in the history like a reply cut by max_tokens (the Triton path's rule); the trailing step tells
        the encoder what was kept."""
        if context is None:
            return
        await context.async_killed_or_stopped()
        sink.closed = True
        LOG.warning("decoder: the caller stopped a turn; it ends as cancelled")


async def serve(settings: WorkerSettings) -> None:
    loop = asyncio.get_running_loop()
    runtime = make_runtime(loop)
    step_client = await runtime.endpoint(ENCODER_STEP).client()
    control_client = await runtime.endpoint(ENCODER_CONTROL).client()
    worker = DecoderWorker(settings, step_client, control_client, loop)
    await worker.channel.start()
    endpoint = runtime.endpoint(DECODER_TURN)
    worker.stats.instance_id = endpoint.connection_id()
    worker.stats.flush()
    LOG.warning("%s serving (instance %s)", settings.name, worker.stats.instance_id)
    await asyncio.gather(endpoint.serve_endpoint(worker.turn),
                         announce_ready(runtime, DECODER_TURN, settings, worker.stats.instance_id))


def main(argv: list[str] | None = None) -> None:
    import uvloop

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    uvloop.run(serve(WorkerSettings.from_args("decoder", argv)))


if __name__ == "__main__":
    main()
