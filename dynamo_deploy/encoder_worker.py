"""The encoder component: encoder engine, the sessions' encoder state, the MoL2 router step, hand-over out.

Endpoints (namespace `mol2`, component `encoder`):
- `generate`: registered with Dynamo's OpenAI frontend (token ids in, token ids out). Finds the conversation's
  session, encodes the new user turn (or rebuilds the session from the whole prompt), routes it, and streams the
  turn from the decoder worker that holds the session (`Client.direct` to that instance), sending the hand-over
  rows and the ADAPTER_HASH with the request. A completions prompt (raw ids, no template) and a request for `n` > 1
  choices are served as turns kept as no session (`_detached`: one prefill, choices forked from it).
- `step`: the decoder's per-token call: each active session's newest tokens -> their hand-over rows.
- `control`: rollback / end of a session's turn (the decoder's clean-up calls).
Frontend -> encoder affinity is Dynamo's (`--router-session-affinity-ttl-secs` with `x-dynamo-session-id`, which
reaches the worker as `agent_context.session_id`); encoder -> decoder is direct routing by the decoder instance id
kept in the session's record here. A session whose decoder is gone, or whose prompt does not continue what the
worker holds, is rebuilt from the prompt on a live decoder (a fresh internal session id, so nothing stale is reused).

Who may touch a session (session_guard.py): the turn that starts a session id here issues its session token (in the
first chunk's `engine_data`); every later turn of that id must present it (an `nvext.annotations` entry), or it is
refused with session_auth's one message before anything is read, ended or replaced. A conversation without a
session id is kept under a digest of its whole history, so only a request that resends that exact history finds it.
`step` and `control` take only calls signed with the deployment's internal key (the decoders'), and the hand-over
sent to a decoder carries the encoder's grant.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import numpy as np

from ced.text.tokenizer import ChatTokenizer
from ced.text.tool_parsers import syntax_of
from dynamo_deploy.conversation import SessionRecord, continuation, fingerprint, is_chat_prompt, reply_ids, split_turn
from dynamo_deploy.model_ids import explicit_adapter, explicit_ids
from dynamo_deploy.requests import choices_of, echoes, openai_finish, params_to_json, sampling_params
from dynamo_deploy.session_guard import (
    ENGINE_DATA_FIELD,
    ENGINE_DATA_KEY,
    PATH_CONTROL,
    PATH_STEP,
    PATH_TURN,
    CallAuth,
    anonymous_key,
    load_internal_key,
    presented_token,
    wants_engine_data,
)
from dynamo_deploy.tool_choice import STRUCTURAL_TAG_POLICY, parser_for
from dynamo_deploy.transfer import HandoverChannel
from dynamo_deploy.wire import nbytes, pack
from dynamo_deploy.worker_common import (
    ENCODER_CONTROL,
    ENCODER_STEP,
    MODEL_NAME,
    NAMESPACE,
    WorkerSettings,
    WorkerStats,
    announce_ready,
    make_runtime,
)
from tritonserver_backend.adapters.registry import Registry
from tritonserver_backend.auth.session_auth import SessionRefused, SessionTokens, first_position, grant_subject, refusal
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.core.encoder_service import DEFAULT_PREFILL_STEP, EncodedTurn, EncoderService
from tritonserver_backend.core.prefix_cache import DEFAULT_BUDGET_BYTES
from tritonserver_backend.core.router_service import RouterService
from tritonserver_backend.engines import open_engine
from tritonserver_backend.errors import BadRequest, ServingError, UnknownSession

LOG = logging.getLogger("mol2.encoder")
MAX_RECORDS = 10_000
NOT_A_CHAT_TURN = ("a chat prompt must end with the assistant prompt (a partial reply resent by request migration is "
                   "not continued: resend the turn)")
SETTLE_TIMEOUT_S = 120.0  # a cancelled turn's decoder has this long to end it; else the session is rebuilt next turn
# where a record is kept: (anonymous, key); key = the x-dynamo-session-id, or anonymous_key(history)
Slot = tuple[bool, str]


class DecoderLost(RuntimeError):
    """The decoder worker could not be reached before the turn started: rebuild elsewhere."""


class ClientLeft(Exception):
    """Dynamo stopped the request's context: the client disconnected."""


def for_client(exc: ServingError) -> Exception:
    """An error whose message the client should read: Dynamo's frontend answers a worker's `InvalidArgument` with HTTP
    400 and its message (streamed: an error event with it); any other exception becomes a bare HTTP 500, and
    `HttpError(403, ...)` a 403 without the message (measured on ai-dynamo 1.6.1)."""
    try:
        from dynamo.llm.exceptions import InvalidArgument
    except ImportError:  # outside the Dynamo venv (unit tests)
        return exc
    return InvalidArgument(str(exc))


def lost_mid_reply(decoder: int, exc: BaseException) -> Exception:
    """The decoder worker streaming a turn was lost after its first token. The client gets HTTP 503 (streamed: an
    error event `service_unavailable`, code 503) and should resend the turn: the session was marked for a rebuild, so
    the resent conversation (without the cut reply) is served from a rebuilt state on a live decoder, with the tokens
    an undisturbed session would have got. Dynamo's frontend gives a worker's message only with HTTP 400
    (`InvalidArgument`), which would tell the client its request was wrong; the reason goes to the worker's log."""
    LOG.warning("decoder instance %s was lost mid-reply (%r); the client is told 503 and its session rebuilds on "
                "the next turn", decoder, exc)
    try:
        from dynamo.llm.exceptions import HttpError
    except ImportError:  # outside the Dynamo venv (unit tests)
        return RuntimeError(f"decoder instance {decoder} was lost mid-reply")
    return HttpError(503, f"decoder instance {decoder} was lost mid-reply; resend the turn")


class EncoderWorker:
    def __init__(self, settings: WorkerSettings, decoders: Any) -> None:
        self.settings, self.decoders = settings, decoders
        self.counters = Counters()
        self.stats = WorkerStats(settings, self.counters)
        engine = open_engine(settings.backend, settings.model_dir, settings.engine_dir, settings.tensor_parallel_size,
                             settings.expert_parallel)
        # the client's token is checked here, per x-dynamo-session-id, which outlives the service's internal session ids
        # (a rebuild starts a new one); the service is reached only through this worker's endpoints
        self.encoder = EncoderService(engine, max_context=settings.max_context, counters=self.counters,
                                      session_auth=False, prefix_cache_bytes=DEFAULT_BUDGET_BYTES)
        # x-dynamo-session-id -> its token's digest, while its record lives
        self.tokens = SessionTokens(settings.session_auth)
        self.key = load_internal_key(settings.internal_key_path)
        self.calls = CallAuth(self.key)
        self.router = RouterService(settings.model_dir, Registry(settings.registry_root), self.counters, engine)
        self.tokenizer = ChatTokenizer.load(settings.model_dir)
        self.tool_syntax = syntax_of(self.tokenizer.chat_format)  # how the model writes calls (tool_choice.py)
        self.channel = HandoverChannel(settings.nixl_threshold, self.stats)
        self.records: OrderedDict[Slot, SessionRecord] = OrderedDict()
        self.dead: set[int] = set()
        self.absorbed: dict[str, list[int]] = {}  # internal session id -> the tokens its turn in flight fed back here
        self.drafted: dict[str, list[int]] = {}  # internal session id -> its speculative step's tokens, not kept yet
        # internal session id -> its turn's end: the reply it kept, or None
        self.settling: dict[str, asyncio.Future] = {}
        self._settles: set[asyncio.Task] = set()
        self._serial = itertools.count()
        self._next = itertools.count()
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="encoder-engine")  # the services are single-threaded

    async def run(self, call: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._compute, call, *args)

    async def encode_turn(self, *args: Any) -> EncodedTurn:
        """`EncoderService.encode_turn`, one prefill piece per call on the engine thread: the decoders' step calls
        that arrive meanwhile queue between two pieces, so a long prompt delays their streams by at most one piece
        (prefill_queue.py says why). A turn whose client left is dropped; its session stays as it was."""
        turn = await self.run(self.encoder.begin_turn, *args)
        try:
            while not await self.run(self.encoder.advance_turn, turn, DEFAULT_PREFILL_STEP):
                pass
            return await self.run(self.encoder.finish_turn, turn)
        except BaseException:
            self._compute.submit(self.encoder.abandon_turn, turn)  # in order on the engine thread, even when cancelled
            raise

    # ------------------------------------------------------------------ the frontend's endpoint
    async def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        prompt = [int(t) for t in request["token_ids"]]
        # a /v1/completions prompt is the text's ids as they are (no template, so no <|bos|>): a raw turn
        raw = bool(prompt) and prompt[0] != self.tokenizer.bos_id
        if not raw and not is_chat_prompt(self.tokenizer, prompt):
            # e.g. a request Dynamo migrated mid-reply (prompt + partial reply): continuing it would encode the
            # partial reply as a user turn, silently wrong
            raise for_client(BadRequest(NOT_A_CHAT_TURN))
        try:  # a bad or unservable sampling option is refused before any session is touched
            params = sampling_params(request, self.tool_syntax)
            if echoes(request) and not raw:
                raise BadRequest("prompt log-probabilities (echo) are served for completions prompts only")
        except ServingError as exc:
            raise for_client(exc) from None
        n = choices_of(request)
        explicit = explicit_adapter(request.get("model"))  # an explicit adapter always wins over routing
        if raw or n > 1:  # kept as no session: a completions prompt, or n choices forked from one prefill
            history, turn = ([self.tokenizer.bos_id], prompt) if raw else split_turn(self.tokenizer, prompt)
            if raw:
                params = dataclasses.replace(params, raw=True)
            if raw and echoes(request):
                # echo: the session starts from <|bos|> alone and the decoder emits the prompt itself by teacher
                # forcing, each prompt token with its log-probability, then samples max_tokens more (the single-server
                # path's echo, openai_frontend/completions.py); Dynamo's frontend then returns prompt + completion
                history, turn = [], [self.tokenizer.bos_id]
                params = dataclasses.replace(params, forced_ids=tuple(prompt))
            detached = self._detached(turn, history, params, explicit, n, context, "raw" if raw else "choices")
            async with contextlib.aclosing(detached) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        session_id = (request.get("agent_context") or {}).get("session_id")
        if session_id:
            key = str(session_id)
            slot: Slot = (False, key)
            try:
                # before anything is read
                issued = self._admit(key, presented_token(request), wants_engine_data(request))
            except ServingError as exc:
                raise for_client(exc) from None
        else:
            key = anonymous_key(split_turn(self.tokenizer, prompt)[0])
            slot, issued = (True, key), ""
        to_client = params.logprobs  # the client asked for them (output_options.logprobs)
        if self.settings.record_logprobs:
            params = dataclasses.replace(params, logprobs=True)
        handed: list[bool] = []  # set once a chunk (the first carries an issued token) went to the frontend
        try:
            for _ in range(1 + len(self.decoders.instance_ids())):
                try:
                    async with contextlib.aclosing(self._turn(slot, key, prompt, params, explicit, context,
                                                              issued, to_client)) as turn:
                        async for chunk in turn:  # a client that leaves closes this generator, and so the turn's
                            handed.append(True)
                            yield chunk
                    return
                except DecoderLost as exc:
                    LOG.warning("%s: %s; rebuilding the session on another decoder", self.settings.name, exc)
            raise RuntimeError("no decoder worker could take the turn")
        except BaseException:
            if issued and not handed:  # the client never got the token: the session id is free again, with no record
                self.tokens.restore(key, None)
                self.records.pop(slot, None)
            raise

    def _admit(self, session_id: str, token: str | None, wants_token: bool) -> str:
        """A turn under `session_id`: -> the token to issue when it starts the session ("" when the session is live
        and `token` is its token). A live session's turn without its token is refused (the one message, counted)
        before anything is read, ended or replaced. Check and issue run without a pause, so two requests racing to
        start one id cannot both own it."""
        if not self.tokens.enabled:
            return ""
        if self.tokens.digest(session_id) is not None:
            if not self.tokens.matches(session_id, token):
                self._refused(PATH_TURN)
                raise refusal(session_id)
            return ""
        if not wants_token:
            raise BadRequest(f"a turn that starts session {session_id!r} must ask for its session token: list "
                             f"{ENGINE_DATA_FIELD!r} in nvext.extra_fields (it comes back in nvext.engine_data."
                             f"{ENGINE_DATA_KEY}; later turns present it as the nvext.annotations entry "
                             f"'mol2-session-token:<token>')")
        return self.tokens.issue(session_id)

    def _refused(self, path: str) -> None:
        """Count a refused check (stats `session_token_refusals/<path>`); what was presented is never logged."""
        self.counters.add(k.TOKEN_REFUSALS, path)
        self.stats.flush()

    def _remember(self, slot: Slot, record: SessionRecord) -> None:
        self.records[slot] = record
        self.records.move_to_end(slot)
        while len(self.records) > MAX_RECORDS:
            (anonymous, key), _ = self.records.popitem(last=False)
            if not anonymous:
                self.tokens.forget(key)  # the id's record is gone: its token opens nothing (its owner is told why)

    def _commit(self, slot: Slot, record: SessionRecord, expected: list[int]) -> None:
        """The turn ended: the record continues under `expected`. An anonymous conversation's record is kept only from
        now, under its new history's key (the one it continued from, if any, is dropped): one whose turn is in flight
        is found by nobody, so a second conversation with the same opening never meets it."""
        record.expected = expected
        record.turns += 1
        if slot[0]:
            held = self.records.get(slot)
            if held is not None and held.session_id == record.session_id:
                del self.records[slot]
            self._remember((True, anonymous_key(expected)), record)

    def _spoil(self, slot: Slot, record: SessionRecord) -> None:
        """Never continue a session whose last turn failed: its next turn rebuilds (a session id keeps its token)."""
        held = self.records.get(slot)
        if held is not None and held.session_id == record.session_id:
            held.expected = []

    async def _turn(self, slot: Slot, key: str, prompt: list[int], params: Any, explicit: str | None, context: Any,
                    issued: str, logprobs_to_client: bool = False) -> AsyncIterator[dict[str, Any]]:
        record = self.records.get(slot)
        new = continuation(record, prompt)
        live = [i for i in self.decoders.instance_ids() if i not in self.dead]
        if not live:
            raise RuntimeError("no decoder worker is registered")
        encoded = None
        if record is not None and new is not None and record.decoder_instance in live:
            try:
                encoded = await self.encode_turn(record.session_id, np.asarray(new, np.int64), None, False)
                sid, target, rebuilt = record.session_id, record.decoder_instance, False
            except UnknownSession:  # evicted here meanwhile: rebuild below
                encoded = None
        if encoded is None:
            history, turn = split_turn(self.tokenizer, prompt)
            if record is not None:
                await self.run(self.encoder.end, record.session_id)
            # unique across restarts: never meets a stale session
            sid = f"{key}#{self.stats.instance_id}.{next(self._serial)}"
            target = live[next(self._next) % len(live)]
            rebuilt = len(history) > 1
            encoded = await self.encode_turn(sid, np.asarray(turn, np.int64), np.asarray(history, np.int64), True)
        h19, handover = encoded.h19, encoded.handover
        routed = (await self.run(self.router.route, [h19], [explicit]))[0]
        if isinstance(routed, Exception):
            await self.run(self.encoder.rollback, sid)
            raise routed
        record = SessionRecord(sid, decoder_instance=target, turns=(record.turns if record else 0))
        if not slot[0]:  # an anonymous record is kept once its turn ends (_commit)
            self._remember(slot, record)
        t0 = time.perf_counter()
        payload, held = await self._decoder_request(sid, int(routed), params, handover)
        token_data = {"engine_data": {ENGINE_DATA_KEY: issued}} if issued else {}  # rides on the first chunk
        self.stats.add(handover_turns=1, handover_turn_bytes=nbytes(handover),
                       handover_turn_rows=int(handover["positions"].size),
                       handover_turn_pack_s=time.perf_counter() - t0)
        generated: list[int] = []
        logprobs: list[float] = []
        started = False
        log = dict(session=key, internal_session=sid, fingerprint=fingerprint(prompt, self.tokenizer.end_of_turn_id),
                   decoder=target, rebuilt=rebuilt, prompt_tokens=len(prompt),
                   new_tokens=int(handover["positions"].size), adapter_hash=int(routed),
                   explicit=explicit, transport=next(iter(payload["handover"])), handover_bytes=nbytes(handover))
        self.absorbed[sid] = []
        self.settling[sid] = asyncio.get_running_loop().create_future()
        downstream = self._downstream_context()
        left = asyncio.ensure_future(self._client_left(context))
        settle_later = False
        try:
            stream = await self.decoders.direct(payload, target, context=downstream)
            async for chunk in stream:
                if left.done():
                    raise ClientLeft()
                data = chunk.data()
                if "error" in data:
                    raise ServingError(data["error"])
                started = True
                if "token" in data:
                    generated.append(int(data["token"]))
                    if "logprob" in data:
                        logprobs.append(float(data["logprob"]))
                    chunk, token_data = {"token_ids": [int(data["token"])], "index": 0, **token_data}, {}
                    if logprobs_to_client and "logprob" in data:
                        chunk.update(self._logprobs_chunk(data))
                    yield chunk
                if "finish" in data:
                    self.settling.pop(sid, None)
                    self._commit(slot, record, prompt + reply_ids(self.tokenizer, generated))
                    self.stats.add(turns=1, rebuilds=int(rebuilt))
                    self.stats.log_turn(**log, tokens=generated, finish=data["finish"],
                                        **({"logprobs": logprobs} if params.logprobs else {}))
                    self.stats.flush()
                    yield {"token_ids": [], "index": 0, "finish_reason": openai_finish(data["finish"]), **token_data}
                    return
            raise ServingError(f"decoder {target} ended the turn's stream without a finish")
        except (GeneratorExit, asyncio.CancelledError, ClientLeft) as exc:  # the client left mid-turn
            if sid in self.settling:
                settle_later = True
                LOG.warning("%s: the client of %s left mid-turn (%s); stopping the decoder's turn", self.settings.name,
                            key, type(exc).__name__)
                downstream.stop_generating()  # the decoder ends the turn as "cancelled" and keeps the partial reply
                task = asyncio.ensure_future(self._settle_cancelled(slot, record, prompt, generated, log))
                self._settles.add(task)
                task.add_done_callback(self._settles.discard)
            if not isinstance(exc, ClientLeft):
                raise
        except ServingError:
            self._spoil(slot, record)  # never continue a session whose last turn failed: the next one rebuilds
            if not started:  # e.g. the decoder refused the hand-over: nothing of the turn was absorbed there
                await self.run(self.encoder.rollback, sid)
            raise
        except Exception as exc:  # noqa: BLE001 - a transport failure
            self._spoil(slot, record)
            if started:  # the reply is cut: the client retries the turn, which rebuilds the session elsewhere
                raise lost_mid_reply(target, exc) from exc
            self.dead.add(target)
            if held is not None:
                held.cancel()  # nobody will read the buffer: release it now
            await self.run(self.encoder.rollback, sid)
            raise DecoderLost(f"decoder instance {target} unreachable ({exc!r})") from exc
        finally:
            left.cancel()
            if not settle_later:
                self.absorbed.pop(sid, None)
                self.drafted.pop(sid, None)
                self.settling.pop(sid, None)

    def _logprobs_chunk(self, data: dict[str, Any]) -> dict[str, Any]:
        """A token's log-probability and its position's most likely alternatives, in the fields of Dynamo's
        `LLMEngineOutput` the frontend turns into `choices[].logprobs` (one entry per token of the chunk)."""
        top = [{"rank": r + 1, "token_id": int(i), "token": self.tokenizer.decode([int(i)], skip_special=False),
                "logprob": float(v)} for r, (i, v) in enumerate(data.get("top") or ())]
        return {"log_probs": [float(data["logprob"])], "top_logprobs": [top]}

    # ------------------------------------------------------------------ turns kept as no session: n > 1, completions
    async def _detached(self, turn_ids: list[int], prefix_ids: list[int], params: Any, explicit: str | None, n: int,
                        context: Any, kind: str) -> AsyncIterator[dict[str, Any]]:
        """A request whose turns are kept as no session: `n` > 1 chat choices, and raw completions prompts.

        The prompt is encoded once, in a session of its own. One choice is decoded in that session, which ends with
        its turn. `n` > 1 choices are made as the project's OpenAI frontend makes them (openai_frontend/
        chat_choices.py, completions.py): the prompt's decoder side is a prefill-only turn (nothing sampled) and each
        choice is a session forked from it on both sides (the encoder copies its state, the decoder its global-KV
        mirror and replay window: nothing is re-encoded), sampled with seed + i and ended with its turn; they run one
        after another (a fork needs its source idle). Echo with `n` > 1: the prompt's turn is the forced prompt alone
        (`forced_ids`, nothing sampled), whose tokens and log-probabilities head every choice. Dynamo's frontend
        passes `n` once and reads each choice's chunks by their `index`. Like the single server's, such turns are not
        continued as sessions: a later chat turn that resends a choice rebuilds (or continues its own session id's
        record)."""
        live = [i for i in self.decoders.instance_ids() if i not in self.dead]
        if not live:
            raise RuntimeError("no decoder worker is registered")
        target = live[next(self._next) % len(live)]
        holder = f"{kind}#{self.stats.instance_id}.{next(self._serial)}"
        encoded = await self.encode_turn(holder, np.asarray(turn_ids, np.int64), np.asarray(prefix_ids, np.int64),
                                         True)
        forks: list[str] = []
        left = asyncio.ensure_future(self._client_left(context))
        try:
            routed = (await self.run(self.router.route, [encoded.h19], [explicit]))[0]
            if isinstance(routed, Exception):
                raise routed
            echoed: list[dict[str, Any]] = []  # echo with n > 1: the prompt's chunks, teacher-forced once
            if n > 1:
                # the prompt's decoder side: a prefill-only turn, or under echo the forced prompt alone (its tokens
                # and log-probabilities head each choice, as the project's OpenAI frontend does)
                async for data in self._decode(holder, target, int(routed), dataclasses.replace(params, max_tokens=0),
                                               encoded.handover, left):
                    if "token" in data:
                        echoed.append(data)
            replies: list[list[int]] = []
            for j in range(n):
                sid, handover, source = holder, encoded.handover, ""
                reply: list[int] = []
                seeded = dataclasses.replace(params, seed=params.seed + j)
                if n > 1:
                    sid, source = f"{holder}.{j}", holder
                    forks.append(sid)
                    handover = (await self.encode_turn(sid, np.zeros(0, np.int64), None, True, None, holder)).handover
                    seeded = dataclasses.replace(seeded, forced_ids=())  # the fork holds the forced prompt already
                    for data in echoed:
                        reply.append(int(data["token"]))
                        yield {"token_ids": [int(data["token"])], "index": j,
                               **(self._logprobs_chunk(data) if params.logprobs and "logprob" in data else {})}
                # the last choice's fork also ends the prompt's session on the decoder, once copied
                async for data in self._decode(sid, target, int(routed), seeded, handover, left, fork_from=source,
                                               end_session=True, end_source=n > 1 and j == n - 1):
                    if "token" in data:
                        reply.append(int(data["token"]))
                        yield {"token_ids": [int(data["token"])], "index": j,
                               **(self._logprobs_chunk(data) if params.logprobs and "logprob" in data else {})}
                    if "finish" in data:
                        if j == n - 1:  # recorded before the last chunk: the client may look right after it
                            self.stats.add(turns=1, **({"choice_turns": n} if n > 1 else {}))
                            self.stats.log_turn(session=holder, internal_session=holder, decoder=target,
                                                rebuilt=False, prompt_tokens=len(prefix_ids) + len(turn_ids),
                                                new_tokens=int(encoded.handover["positions"].size),
                                                adapter_hash=int(routed), explicit=explicit, choices=n,
                                                tokens=[*replies, reply] if n > 1 else reply)
                            self.stats.flush()
                        yield {"token_ids": [], "index": j, "finish_reason": openai_finish(data["finish"])}
                replies.append(reply)
        finally:
            left.cancel()
            for sid in [holder, *forks]:  # a choice's decoder ends it with its turn; a failed one may be left here
                await self.run(self.encoder.end, sid)

    async def _decode(self, sid: str, target: int, adapter_hash: int, params: Any, handover: dict[str, Any],
                      left: asyncio.Future, fork_from: str = "", end_session: bool = False,
                      end_source: bool = False) -> AsyncIterator[dict[str, Any]]:
        """One decoder turn of a detached request: the decoder's chunks up to the finish. `end_session`: the turn ends
        its session on the decoder (and, through the decoder's clean-up call, here); `end_source`: a fork that also
        ends its source there once copied (scheduler.TurnStart)."""
        payload, _ = await self._decoder_request(sid, adapter_hash, params, handover, fork_from, end_session,
                                                 end_source)
        downstream = self._downstream_context()
        stream = await self.decoders.direct(payload, target, context=downstream)
        async for chunk in stream:
            if left.done():
                downstream.stop_generating()
                raise ClientLeft()
            data = chunk.data()
            if "error" in data:
                raise ServingError(data["error"])
            yield data
            if "finish" in data:
                return
        raise ServingError(f"decoder {target} ended the turn's stream without a finish")

    async def _decoder_request(self, sid: str, adapter_hash: int, params: Any, handover: dict[str, Any],
                               fork_from: str = "", end_session: bool = False,
                               end_source: bool = False) -> tuple[dict[str, Any], Any]:
        """The decoder's `generate` request for one turn, and the transport's hold on the offered hand-over (None
        when it travels inline). The decoder takes rows under a grant only: it signs the session (a fork's names its
        source) and the hand-over's first position. `end_source`: a fork that ends its source once copied."""
        sent_at = time.time()
        wire, held = await self.channel.offer(handover)
        first = first_position(handover["positions"])
        payload = {"session_id": sid, "encoder": self.stats.instance_id, "adapter_hash": adapter_hash,
                   "params": params_to_json(params), "handover": wire, "sent_at": sent_at,
                   "first_position": first, "grant": self.key.grant(grant_subject(sid, fork_from or None), first)}
        if fork_from or end_session:
            payload.update(fork_from=fork_from, end_session=end_session, end_source=end_source)
        return payload, held

    @staticmethod
    def _downstream_context() -> Any:
        """The decoder call's own Dynamo context: stopping it stops the decoder's turn, whatever the frontend does
        with ours."""
        from dynamo.runtime import Context

        return Context()

    @staticmethod
    async def _client_left(context: Any) -> None:
        if context is not None:
            await context.async_killed_or_stopped()

    async def _settle_cancelled(self, slot: Slot, record: SessionRecord, prompt: list[int], streamed: list[int],
                                log: dict[str, Any]) -> None:
        """A turn whose client left: once the decoder has ended it (its trailing step reached `step` with turn_done),
        the session holds the prompt plus the partial reply as the encoder absorbed it, like a reply cut by max_tokens
        (the Triton path's rule). The record then continues under exactly that history; if the turn failed instead
        (rolled back) or never ended, the record is dropped and the next turn rebuilds. A turn that arrives before
        this settles finds no continuable record and rebuilds: never continued from a state that does not match."""
        sid = record.session_id
        future = self.settling.get(sid)
        kept: list[int] | None = None
        if future is not None:
            try:
                kept = await asyncio.wait_for(asyncio.shield(future), SETTLE_TIMEOUT_S)
            except TimeoutError:
                kept = None
            self.settling.pop(sid, None)
        if not slot[0] and self.records.get(slot) is not record:
            return  # a newer turn of the conversation took over meanwhile
        if kept is None:
            self._spoil(slot, record)
            return
        self._commit(slot, record, prompt + reply_ids(self.tokenizer, kept))
        self.stats.add(turns=1, cancelled_turns=1, rebuilds=int(log["rebuilt"]))
        self.stats.log_turn(**log, tokens=kept, finish="cancelled", client_tokens=len(streamed))
        self.stats.flush()

    # ------------------------------------------------------------------ the decoder's endpoints
    async def step(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        try:
            self.calls.check(ENCODER_STEP, request, request.get("sessions") or ())
        except SessionRefused as exc:  # not a decoder of this deployment: nothing is read or changed
            self._refused(PATH_STEP)
            yield {"error": str(exc)}
            return
        t0 = time.perf_counter()
        sessions, turn_done = list(request["sessions"]), bool(request["turn_done"])
        keep, draft = request.get("keep"), bool(request.get("draft", False))
        try:
            rows = await self.run(self.encoder.encode_step, sessions, np.asarray(request["tokens"], np.int64),
                                  turn_done, None if keep is None else np.asarray(keep, np.int64), draft)
        except ServingError as exc:
            yield {"error": str(exc)}
            return
        compute = time.perf_counter() - t0
        self._absorbed(sessions, request["tokens"], turn_done, keep, draft)
        packed = [pack(r) for r in rows]
        self.stats.add(step_calls=1, step_rows=sum(int(r["positions"].size) for r in rows),
                       step_bytes=sum(nbytes(r) for r in rows), step_compute_s=compute)
        yield {"rows": packed, "compute_s": compute}

    def _absorbed(self, sessions: list[str], tokens: list[list[int]], turn_done: bool, keep: list[int] | None = None,
                  draft: bool = False) -> None:
        """Track what each turn in flight fed back, as the encoder service absorbed it: a speculative step's tokens
        wait until the session's next call keeps a prefix of them (`keep`); at the turn's end (trailing tokens +
        end-of-turn) that is the reply the session keeps, which settles a cancelled turn."""
        for b, (sid, row) in enumerate(zip(sessions, tokens)):
            if sid in self.absorbed:
                waiting = self.drafted.pop(sid, [])
                if keep is not None and keep[b] >= 0:
                    self.absorbed[sid].extend(waiting[:keep[b]])
                if draft:
                    self.drafted[sid] = [int(t) for t in row]
                else:
                    self.absorbed[sid].extend(int(t) for t in row)
            if turn_done:
                kept = self.absorbed.pop(sid, [])[:-1]  # without the end-of-turn
                future = self.settling.get(sid)
                if future is not None and not future.done():
                    future.set_result(kept)

    def _dropped(self, sid: str) -> None:
        self.absorbed.pop(sid, None)
        self.drafted.pop(sid, None)
        future = self.settling.get(sid)
        if future is not None and not future.done():
            future.set_result(None)

    async def control(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        op, sid = request.get("op"), str(request.get("session_id"))
        try:
            self.calls.check(ENCODER_CONTROL, request, [sid])
        except SessionRefused as exc:
            self._refused(PATH_CONTROL)
            yield {"error": str(exc)}
            return
        if op in ("rollback", "end"):
            self._dropped(sid)
        if op == "rollback":
            await self.run(self.encoder.rollback, sid)
        elif op == "end":
            await self.run(self.encoder.end, sid)
        yield {"ok": op in ("rollback", "end")}


async def serve(settings: WorkerSettings) -> None:
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    loop = asyncio.get_running_loop()
    runtime = make_runtime(loop)
    decoders = await runtime.endpoint(f"{NAMESPACE}.decoder.turn").client()
    worker = EncoderWorker(settings, decoders)
    await worker.channel.start()
    generate = runtime.endpoint(f"{NAMESPACE}.encoder.generate")
    step = runtime.endpoint(ENCODER_STEP)
    control = runtime.endpoint(ENCODER_CONTROL)
    worker.stats.instance_id = step.connection_id()
    worker.stats.flush()
    model_path = str(settings.run_dir / "model")
    # every card (the LoRA ones too: each carries its own) tells the frontend how to read tool calls out of a reply
    # and to send tool_choice as a structural tag, which the worker enforces in the model's own syntax (tool_choice.py)
    card = ModelRuntimeConfig()
    card.tool_call_parser = parser_for(worker.tool_syntax)
    if card.tool_call_parser is not None:
        card.set_structural_tag(STRUCTURAL_TAG_POLICY)
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, generate,
                         model_path, MODEL_NAME, worker_type=WorkerType.Aggregated, kv_cache_block_size=16,
                         runtime_config=card)
    for name in explicit_ids(Registry(settings.registry_root)):  # one LoRA card per explicit choice (model_ids.py)
        await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, generate, model_path,
                             worker_type=WorkerType.Aggregated, kv_cache_block_size=16, lora_name=name,
                             base_model_path=model_path, runtime_config=card)
    LOG.warning("%s serving (instance %s)", settings.name, worker.stats.instance_id)
    await asyncio.gather(generate.serve_endpoint(worker.generate), step.serve_endpoint(worker.step),
                         control.serve_endpoint(worker.control),
                         announce_ready(runtime, ENCODER_STEP, settings, worker.stats.instance_id))


def main(argv: list[str] | None = None) -> None:
    import uvloop

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    uvloop.run(serve(WorkerSettings.from_args("encoder", argv)))


if __name__ == "__main__":
    main()
