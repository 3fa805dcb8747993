"""The decoder model's Triton side: requests in, streamed responses out, the encoder through BLS, one thread.

Every `pb_utils` call of the decoder stub happens on the scheduler thread (`TurnWorker` runs `handle_requests` and
`TurnScheduler.iterate` there), except each step's BLS call to the encoder, which runs on the scheduler's
encoder-call thread while responses stream: `execute` only queues the request objects. See docs/load.md for why: a
custom metric's `increment` rewrites the metric's shared-memory record, and two threads incrementing at once made the
stub throw `boost::interprocess::lock_exception` and the server take Signal 11.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tritonserver_backend import contract as c
from tritonserver_backend.auth.session_auth import GrantLedger, InternalKey, first_position, grant_subject
from tritonserver_backend.core.decoder_service import TokenLogprobs, Turn
from tritonserver_backend.core.handover import Handover
from tritonserver_backend.core.scheduler import TurnScheduler, TurnStart
from tritonserver_backend.core.text_service import TextService
from tritonserver_backend.errors import BadRequest
from tritonserver_backend.triton import glue
from tritonserver_backend.triton.handover_codec import rows_from_arrays

LOG = logging.getLogger("mol2")
EMPTY = np.zeros(0, np.int64)


class BlsEncoderPort:
    """The scheduler's encoder port: one BLS request to the `encoder` model per call, whatever the batch size; each
    carries the server's internal key (the encoder takes steps, rollbacks and drops from this model only)."""

    def __init__(self, key: InternalKey) -> None:
        self.key = key

    def _call(self, session_id: str, extra: dict[c.TensorSpec, Any],
              outputs: list[c.TensorSpec]) -> dict[str, np.ndarray]:
        inputs = {c.SESSION_ID: session_id, c.TOKEN_IDS: EMPTY, c.PREFIX_IDS: EMPTY, c.START: False,
                  c.INTERNAL_KEY: self.key.value, **extra}
        return glue.bls("encoder", inputs, outputs)

    def step(self, session_ids: list[str], tokens: np.ndarray, turn_done: bool, keep: np.ndarray | None = None,
             draft: bool = False, turn_ids: np.ndarray | None = None) -> list[Handover]:
        extra: dict[c.TensorSpec, Any] = {c.STEP_SESSION_IDS: session_ids, c.STEP_TOKEN_IDS: tokens,
                                          c.TURN_DONE: turn_done}
        if keep is not None:
            extra[c.STEP_KEEP] = keep
        if draft:
            extra[c.STEP_DRAFT] = True
        if turn_ids is not None:
            extra[c.STEP_TURN_IDS] = np.asarray(turn_ids, np.int64)
        out = self._call(session_ids[0], extra, list(c.HANDOVER))
        return rows_from_arrays(out, [tokens.shape[1]] * len(session_ids))

    def rollback(self, session_id: str, turn_id: int = 0) -> bool:
        """-> whether the encoder still had the turn open (it says so in ISSUED_TOKEN)."""
        extra: dict[c.TensorSpec, Any] = {c.ROLLBACK: True}
        if turn_id:
            extra[c.STEP_TURN_IDS] = np.asarray([turn_id], np.int64)
        out = self._call(session_id, extra, [c.ISSUED_TOKEN])
        return out[c.ISSUED_TOKEN.name].reshape(-1)[0] in (b"rolled_back", "rolled_back")

    def claim(self, session_id: str, turn_id: int) -> None:
        self._call(session_id, {c.CLAIM_TURN: True, c.STEP_TURN_IDS: np.asarray([turn_id], np.int64)}, [])

    def drop(self, session_id: str) -> None:
        self._call(session_id, {c.DROP_SESSION: True}, [])


@dataclass
class StreamClock:
    """When a turn arrived (ns since the epoch: preprocess's ARRIVAL_NS, or the decoder's own receipt for a request
    sent to the decoder directly), and when its first and latest token responses went out."""

    arrival_ns: int
    first_ns: int | None = None
    last_ns: int | None = None
    tokens: int = 0  # tokens sent so far


@dataclass(frozen=True)
class Client:
    """Where a turn's responses go (the TurnStart's context): the request, asked whether its client left; its
    response sender; whether the client reads a stream or wants the whole reply in one final response (Triton's HTTP
    /generate accepts only one response from a model, and refuses it only after the model has run the turn); the
    clock its latencies are measured on."""

    request: Any
    sender: Any
    stream: bool = True
    clock: StreamClock = field(default_factory=lambda: StreamClock(time.time_ns()))
    issued_token: str = ""  # the session token the encoder issued when this turn (re)started the session


class HandoverGuard:
    """The decoder's side of session_auth.py: hand-over rows are taken only under a fresh grant of this server's
    encoder, newer than the session's last, and CONTROL only with the server's internal key. So a client that calls
    the `decoder` model directly can neither overwrite a session's decoder state nor cancel its turn."""

    def __init__(self, key: InternalKey) -> None:
        self.key, self.ledger = key, GrantLedger()

    def admit(self, session_id: str, grant: str | None, first_position: int, fork_from: str | None = None) -> int:
        """Take the hand-over's grant -> its issue time, which is the turn's id on the encoder (turn_lease.py)."""
        issued = self.key.verify(grant, grant_subject(session_id, fork_from), first_position)
        self.ledger.take(session_id, issued)
        return issued

    def check_control(self, presented: str | None) -> None:
        if not self.key.matches(presented):
            raise BadRequest(f"{c.CONTROL.name} is sent by session_control only (model {c.SESSION_CONTROL.name!r})")


class LatencyRecorder(Protocol):
    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...


def read_turn(request: Any, guard: HandoverGuard) -> TurnStart:
    """The decoder's inputs as a TurnStart (its hand-over checked by `guard`); the response sender rides along as
    its context."""
    sender = request.get_response_sender()
    context = Client(request, sender)  # until `stream` is read, so that a bad value is answered too
    try:
        arrival = glue.read(request, c.ARRIVAL_NS.as_optional(), None)
        clock = StreamClock(int(arrival) if arrival is not None else time.time_ns())
        context = Client(request, sender, bool(glue.read(request, c.STREAM, True)), clock,
                         glue.read(request, c.ISSUED_TOKEN.as_optional(), ""))
        handover = rows_from_arrays({spec.name: glue.read(request, spec) for spec in c.HANDOVER})[0]
        session_id = glue.read(request, c.SESSION_ID)
        fork = glue.read(request, c.FORK_FROM, None)
        turn_id = guard.admit(session_id, glue.read(request, c.GRANT.as_optional(), None),
                              first_position(handover["positions"]), fork)
        return TurnStart(session_id, handover, int(glue.read(request, c.ADAPTER_HASH)),
                         glue.sampling_params(request), bool(glue.read(request, c.END_SESSION, False)), context,
                         fork or "", turn_id=turn_id)
    except Exception as exc:
        exc.context = context  # type: ignore[attr-defined]
        raise


def cancelled(request: Any) -> bool:
    """Whether the client went away (gRPC stream closed, request cancelled): Triton reports it on the request."""
    return bool(getattr(request, "is_cancelled", lambda: False)())


CANCEL_CHECK = 8


class Emitter:
    """Streams a turn's tokens to its client: the text piece, the token ids, the adapter that answers, the finish.

    `interval` tokens go out per response (the last response of a turn flushes what is left, then the final empty
    one). Every response costs an IPC round trip from this stub, the ensemble's forwarding in tritonserver and the
    client's handling: at 16 concurrent sessions on 2 cores that is a third of the CPU spent per token (measured,
    docs/load.md). 1 streams every token as it is sampled; a larger interval trades the granularity of the stream
    (never its tokens or the time of the last one) for throughput, like SGLang's `--stream-interval`."""

    def __init__(self, text: TextService, interval: int = 1, latency: LatencyRecorder | None = None) -> None:
        """`latency` observes each streamed turn's time to first token and mean inter-token time (not for a client
        that takes the whole reply in one response: it has no first token before the last)."""
        if interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {interval}")
        self.text, self.interval, self.latency = text, interval, latency

    def __call__(self, turn: Turn, token: int, finish: str) -> bool:
        client: Client = turn.context  # type: ignore[assignment]
        sender = client.sender
        # asking whether the client left is an IPC round trip of its own: ask every CANCEL_CHECK tokens and at the end
        if (token < 0 or len(turn.generated) % CANCEL_CHECK == 1) and cancelled(client.request):
            if token < 0:
                sender.send(flags=glue.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # close the request; nobody reads it
            return False
        if token >= 0:
            turn.unsent.append(token)
            if not client.stream or len(turn.unsent) < self.interval:
                return True
        if not client.stream:  # the end of the turn: the whole reply in the one, final response
            self._flush(turn, sender, finish, glue.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return True
        if turn.unsent:
            self._flush(turn, sender, "", 0)
        if token < 0:
            outputs = {c.TEXT_OUTPUT: "", c.TOKEN_ID_OUT: -1, c.ADAPTER_NAME: turn.adapter_name,
                       c.FINISH_REASON: finish, **logprob_outputs(turn, []),
                       c.ISSUED_SESSION_TOKEN: client.issued_token}
            sender.send(glue.response(outputs), flags=glue.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            clock = client.clock
            if (self.latency is not None and clock.first_ns is not None and clock.last_ns is not None
                    and clock.tokens > 1):
                self.latency.inter_token((clock.last_ns - clock.first_ns) / 1e9 / (clock.tokens - 1))
        return True

    def _flush(self, turn: Turn, sender: Any, finish: str, flags: int) -> None:
        """One response with the turn's unsent token ids and their text."""
        ids, turn.unsent = turn.unsent, []
        first = len(turn.generated) - len(ids)  # the unsent ids are the last of the reply
        client: Client = turn.context  # type: ignore[assignment]
        outputs = {c.TEXT_OUTPUT: "".join(self.text.piece(t) for t in ids), c.TOKEN_ID_OUT: ids,
                   c.ADAPTER_NAME: turn.adapter_name, c.FINISH_REASON: finish,
                   **logprob_outputs(turn, turn.logprobs[first:] if turn.params.logprobs else []),
                   c.ISSUED_SESSION_TOKEN: client.issued_token}
        sender.send(glue.response(outputs), flags=flags)
        if client.stream:
            clock, now = client.clock, time.time_ns()
            if clock.first_ns is None:
                clock.first_ns = now
                if self.latency is not None:
                    self.latency.first_token(max(0, now - clock.arrival_ns) / 1e9)
            clock.last_ns, clock.tokens = now, clock.tokens + len(ids)


def logprob_outputs(turn: Turn, entries: list[TokenLogprobs]) -> dict[c.TensorSpec, np.ndarray]:
    """The log-probability outputs of one response: always present (an ensemble output must be), empty when the
    request did not ask for them or the response carries no token."""
    k = turn.params.top_logprobs
    return {c.TOKEN_LOGPROB_OUT: np.asarray([e.logprob for e in entries], np.float32),
            c.TOP_TOKEN_ID_OUT: np.asarray([e.top_ids for e in entries], np.int32).reshape(len(entries), k),
            c.TOP_LOGPROB_OUT: np.asarray([e.top_logprobs for e in entries], np.float32).reshape(len(entries), k)}


def fail(item: TurnStart | Turn, exc: BaseException) -> None:
    sender = item.context.sender  # type: ignore[union-attr]
    sender.send(glue.error_response(exc), flags=glue.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def handle_requests(scheduler: TurnScheduler, guard: HandoverGuard, requests: list[Any]) -> None:
    """On the scheduler thread: read each request and queue its turn (or carry out its control action); a malformed
    or unauthorised one is answered at once."""
    for request in requests:
        try:
            action = glue.read(request, c.CONTROL, None)
            if action is not None:
                guard.check_control(glue.read(request, c.INTERNAL_KEY, None))
                _control(scheduler, request, action)
                continue
            turn = read_turn(request, guard)
            scheduler.submit(turn)
            _announce_token(turn.context)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            sender = exc.context.sender if hasattr(exc, "context") else request.get_response_sender()
            sender.send(glue.error_response(exc), flags=glue.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _announce_token(client: Client) -> None:
    """A streamed turn that (re)started its session gets the session's token at once, in a response without token ids:
    its client can then cancel the turn while it still waits for a row (the token otherwise arrives with the first
    token). A whole-reply client (stream=false) gets it with its one response."""
    if client.stream and client.issued_token:
        outputs = {c.TEXT_OUTPUT: "", c.TOKEN_ID_OUT: np.zeros(0, np.int32), c.ADAPTER_NAME: "", c.FINISH_REASON: "",
                   c.TOKEN_LOGPROB_OUT: np.zeros(0, np.float32), c.TOP_TOKEN_ID_OUT: np.zeros((0, 0), np.int32),
                   c.TOP_LOGPROB_OUT: np.zeros((0, 0), np.float32), c.ISSUED_SESSION_TOKEN: client.issued_token}
        client.sender.send(glue.response(outputs), flags=0)


def _control(scheduler: TurnScheduler, request: Any, action: str) -> None:
    if action not in ("cancel", "end"):
        raise BadRequest(f"unknown control action {action!r}; expected 'cancel' or 'end'")
    session = glue.read(request, c.SESSION_ID)
    result = scheduler.cancel(session) if action == "cancel" else scheduler.end_idle(session)
    outcome = json.dumps({"session_id": session, "action": action, "outcome": result})
    outputs = {c.TEXT_OUTPUT: outcome, c.TOKEN_ID_OUT: -1, c.ADAPTER_NAME: "", c.FINISH_REASON: ""}
    request.get_response_sender().send(glue.response(outputs), flags=glue.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)


__all__ = ["BlsEncoderPort", "Client", "Emitter", "HandoverGuard", "fail", "handle_requests"]
