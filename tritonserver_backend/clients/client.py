"""Chat clients for the `mol2` ensemble: gRPC bidirectional streaming (tritonclient) and HTTP (generate_stream SSE).

Both return the same `Reply`, so tests and the chat script can compare transports token for token. Each client keeps
the session tokens the server issues (`SessionTokens`: the token of a session's first reply goes with every later
request of that session), so a caller that only names its session ids carries them without doing anything; pass one
`SessionTokens` to several clients that take turns on the same sessions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import numpy as np

from tritonserver_backend import contract as c


@dataclass
class Reply:
    session_token: str = ""  # issued_session_token: set when this turn started (or rebuilt) the session
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    adapter: str = ""
    finish_reason: str = ""
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)  # with TurnRequest.logprobs: one per token id
    top_token_ids: list[list[int]] = field(default_factory=list)  # with top_logprobs k: k ids per token
    top_logprobs: list[list[float]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass
class TurnRequest:
    session_id: str
    text: str
    new_session: bool = False
    adapter: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    history: str | None = None
    end_session: bool = False
    stream: bool = True  # False: the whole reply in one response (HttpChat then calls /generate)
    logprobs: bool = False  # each token's log-probability comes back in Reply.logprobs
    top_logprobs: int | None = None  # and the k most likely alternatives at each position
    session_token: str | None = None  # None: the client's SessionTokens fill in the session's token, if they hold one
    top_k: int | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's shape) -> bias; sent as JSON
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    grammar: dict | None = None  # {"type": "json_object" | "json_schema" | "regex" | "ebnf", ...}; sent as JSON
    speculative: bool = True  # False: this turn opts out of speculative decoding

    raw: bool = False  # completions: text tokenized as it is (no chat template), no end-of-turn after the reply
    forced_ids: list[int] | None = None  # teacher forcing: emitted first, with their log-probabilities
    fork_from: str | None = None  # with new_session: start as a copy of this live, idle session
    fork_token: str | None = None  # that session's token (None: the client's SessionTokens fill it in)
    cache_salt: str | None = None  # the prefix cache partition of a starting session (None: the shared one)
    # JSON list of OpenAI tool definitions, rendered by the chat format (every turn of a session)
    tools: str | None = None
    turn_messages: str | None = None  # JSON list of the messages this turn adds (tool results, user) instead of text

    def tensors(self) -> dict[c.TensorSpec, Any]:
        values: dict[c.TensorSpec, Any] = {c.SESSION_ID: self.session_id, c.TEXT: self.text}
        optional = {
            c.NEW_SESSION: self.new_session or None,
            c.ADAPTER: self.adapter,
            c.MAX_TOKENS: self.max_tokens,
            c.TEMPERATURE: self.temperature,
            c.TOP_P: self.top_p,
            c.SEED: self.seed,
            c.STOP: self.stop,
            c.FREQUENCY_PENALTY: self.frequency_penalty,
            c.PRESENCE_PENALTY: self.presence_penalty,
            c.REPETITION_PENALTY: self.repetition_penalty,
            c.HISTORY: self.history,
            c.END_SESSION: self.end_session or None,
            c.STREAM: None if self.stream else False,
            c.LOGPROBS: self.logprobs or None,
            c.TOP_LOGPROBS: self.top_logprobs,
            c.SESSION_TOKEN: self.session_token,
            c.TOP_K: self.top_k,
            c.MIN_P: self.min_p,
            c.LOGIT_BIAS: (None if self.logit_bias is None
                           else json.dumps({str(k): v for k, v in self.logit_bias.items()})),
            c.STOP_TOKEN_IDS: self.stop_token_ids or None,
            c.MIN_TOKENS: self.min_tokens,
            c.IGNORE_EOS: self.ignore_eos or None,
            c.GRAMMAR: None if self.grammar is None else json.dumps(self.grammar),
            c.SPECULATIVE: None if self.speculative else False,
            c.RAW: self.raw or None,
            c.FORCED_IDS: list(self.forced_ids) if self.forced_ids is not None else None,
            c.FORK_FROM: self.fork_from,
            c.FORK_TOKEN: self.fork_token,
            c.CACHE_SALT: self.cache_salt,
            c.TOOLS: self.tools,
            c.TURN_MESSAGES: self.turn_messages,
        }
        values.update({k: v for k, v in optional.items() if v is not None})
        return values


class SessionTokens:
    """The session tokens a client holds, by session id: the issued token of a reply is kept, and sent with every
    later request of that session that does not name a token itself (after the session ended too: with its token,
    the server says that it ended rather than refusing a stranger)."""

    def __init__(self) -> None:
        self._tokens: dict[str, str] = {}
        self._lock = threading.Lock()

    def outgoing(self, request: TurnRequest) -> TurnRequest:
        if request.fork_from is not None and request.fork_token is None:
            with self._lock:
                fork_token = self._tokens.get(request.fork_from)
            if fork_token is not None:
                request = dataclasses.replace(request, fork_token=fork_token)
        if request.session_token is not None:
            return request
        with self._lock:
            token = self._tokens.get(request.session_id)
        return request if token is None else dataclasses.replace(request, session_token=token)

    def learn(self, request: TurnRequest, reply: Reply) -> None:
        with self._lock:
            if reply.session_token:
                self._tokens[request.session_id] = reply.session_token

    def get(self, session_id: str) -> str | None:
        with self._lock:
            return self._tokens.get(session_id)

    def __setitem__(self, session_id: str, token: str) -> None:
        with self._lock:
            self._tokens[session_id] = token


def input_array(spec: c.TensorSpec, value: Any) -> np.ndarray:
    """One input tensor's value as the array its spec says (BYTES as UTF-8 objects; scalars as shape (1,))."""
    if spec.dtype == "BYTES":
        items = value if isinstance(value, list) else [value]
        return np.array([v.encode("utf-8") for v in items], dtype=np.object_)
    if isinstance(value, (list, tuple)):  # a [-1] input (stop_token_ids)
        return np.asarray(value, dtype=spec.numpy_dtype).reshape(-1)
    return np.asarray([value], dtype=spec.numpy_dtype)


def _add(reply: Reply, tokens: list[int], piece: str, adapter: str, finish: str,
         logprobs: tuple[Any, Any, Any] | None = None, issued_token: str = "") -> None:
    """One streamed response: its token ids (several when the server groups them, `stream_interval`; [-1] on the final
    response), their text and, when asked for, their log-probabilities (token, top ids, top log-probabilities)."""
    ids = [t for t in tokens if t >= 0]
    if ids:
        reply.token_ids.extend(ids)
        reply.pieces.append(piece)
    if logprobs is not None:
        token_lp, top_ids, top_lp = (np.asarray(v) for v in logprobs)
        reply.logprobs.extend(float(x) for x in token_lp.reshape(-1))
        k = top_ids.size // token_lp.size if token_lp.size else 0  # HTTP's JSON flattens (tokens, k)
        if k:
            reply.top_token_ids.extend([int(x) for x in row] for row in top_ids.reshape(-1, k))
            reply.top_logprobs.extend([float(x) for x in row] for row in np.asarray(top_lp, np.float32).reshape(-1, k))
    reply.adapter = adapter or reply.adapter
    reply.finish_reason = finish or reply.finish_reason
    reply.session_token = issued_token or reply.session_token


def text_output(result: Any, spec: c.TensorSpec) -> str:
    """A string output of a streamed response; "" when the response does not carry it (a control reply)."""
    value = result.as_numpy(spec.name)
    return "" if value is None else value.reshape(-1)[0].decode("utf-8", errors="replace")


def infer_inputs(grpc: Any, tensors: dict[c.TensorSpec, Any]) -> list[Any]:
    """A request's tensors as InferInputs of `grpc` (tritonclient.grpc and .aio take the same; the OpenAI frontend's
    async stream builds its requests with this too)."""
    inputs = []
    for spec, value in tensors.items():
        arr = input_array(spec, value)
        inp = grpc.InferInput(spec.name, list(arr.shape), spec.dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


def _grpc_request(grpc: Any, request: TurnRequest) -> dict[str, Any]:
    """The keyword arguments of one streamed ensemble request (tritonclient.grpc and .aio take the same)."""
    outputs = [grpc.InferRequestedOutput(s.name) for s in c.ENSEMBLE_OUTPUTS]
    return {"inputs": infer_inputs(grpc, request.tensors()), "outputs": outputs, "enable_empty_final_response": True}


def _take(reply: Reply, result: Any, error: Any, on_piece: Callable[[str], None] | None) -> bool:
    """One streamed gRPC response into `reply` -> whether it ended the turn (the final response or an error)."""
    if error is not None:
        reply.error = error.message() if hasattr(error, "message") else str(error)
        return True
    final = result.get_response().parameters.get("triton_final_response")
    token_ids = result.as_numpy(c.TOKEN_ID_OUT.name)
    if token_ids is not None:
        ids, piece = [int(t) for t in token_ids.reshape(-1)], text_output(result, c.TEXT_OUTPUT)
        lp = tuple(result.as_numpy(s.name) for s in c.LOGPROB_OUTPUTS)
        _add(reply, ids, piece, text_output(result, c.ADAPTER_NAME), text_output(result, c.FINISH_REASON),
             None if any(v is None for v in lp) else lp, text_output(result, c.ISSUED_SESSION_TOKEN))
        if on_piece is not None and any(t >= 0 for t in ids):  # token-carrying responses, not the final one
            on_piece(piece)
    return final is not None and final.bool_param


class GrpcChat:
    """One gRPC stream; `turn` sends a request and collects its streamed responses until the final one."""

    def __init__(self, url: str, tokens: SessionTokens | None = None) -> None:
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.tokens = tokens if tokens is not None else SessionTokens()
        self.client = grpcclient.InferenceServerClient(url)
        self._results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self._results.put((result, error)))

    def turn(self, request: TurnRequest, timeout: float = 300.0,
             on_piece: Callable[[str], None] | None = None) -> Reply:
        request = self.tokens.outgoing(request)
        self.client.async_stream_infer(c.ENSEMBLE_NAME, **_grpc_request(self._grpc, request))
        reply = Reply()
        while True:
            result, error = self._results.get(timeout=timeout)
            done = _take(reply, result, error, on_piece)
            self.tokens.learn(request, reply)  # as soon as the token arrives: the turn can be cancelled meanwhile
            if done:
                return reply

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


class AsyncGrpcChat:
    """`GrpcChat` for asyncio (tritonclient.grpc.aio): many conversations share one thread and event loop, which costs a
    load generator about a third less CPU per streamed token than a thread per conversation (docs/load.md)."""

    def __init__(self, url: str, tokens: SessionTokens | None = None) -> None:
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as aioclient

        self._grpc = grpcclient
        self.tokens = tokens if tokens is not None else SessionTokens()
        self.client = aioclient.InferenceServerClient(url)
        self._requests: asyncio.Queue = asyncio.Queue()
        self._responses: Any = None

    async def _request_stream(self) -> AsyncIterator[dict[str, Any]]:
        while (item := await self._requests.get()) is not None:
            yield item

    async def turn(self, request: TurnRequest, on_piece: Callable[[str], None] | None = None) -> Reply:
        if self._responses is None:  # the stream opens with the first turn and carries every later one
            self._responses = self.client.stream_infer(self._request_stream()).__aiter__()
        request = self.tokens.outgoing(request)
        await self._requests.put({"model_name": c.ENSEMBLE_NAME, **_grpc_request(self._grpc, request)})
        reply = Reply()
        while True:
            result, error = await self._responses.__anext__()
            done = _take(reply, result, error, on_piece)
            self.tokens.learn(request, reply)
            if done:
                return reply

    async def close(self) -> None:
        await self._requests.put(None)
        await self.client.close()


class HttpChat:
    """HTTP/1.1 `generate_stream` (server-sent events), one event per streamed response; `generate` (one JSON answer)
    for a request with `stream=False`."""

    def __init__(self, url: str, tokens: SessionTokens | None = None) -> None:
        host, _, port = url.partition(":")
        self.host, self.port = host, int(port or 80)
        self.tokens = tokens if tokens is not None else SessionTokens()

    def turn(self, request: TurnRequest, timeout: float = 300.0,
             on_piece: Callable[[str], None] | None = None) -> Reply:
        request = self.tokens.outgoing(request)
        reply = Reply()
        try:
            return self._turn(request, reply, timeout, on_piece)
        finally:
            self.tokens.learn(request, reply)

    def _turn(self, request: TurnRequest, reply: Reply, timeout: float,
              on_piece: Callable[[str], None] | None) -> Reply:
        body = {spec.name: value for spec, value in request.tensors().items()}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            endpoint = "generate_stream" if request.stream else "generate"
            conn.request("POST", f"/v2/models/{c.ENSEMBLE_NAME}/{endpoint}", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                reply.error = _http_error(resp.read())
                return reply
            # a stream is read as it comes (on_piece sees each piece at once); /generate answers with one JSON object
            lines = ((raw.decode("utf-8").strip() for raw in resp) if request.stream
                     else ["data:" + resp.read().decode("utf-8")])
            for line in lines:
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    reply.error = event["error"]
                    return reply
                if c.TOKEN_ID_OUT.name in event:
                    piece = str(_scalar(event.get(c.TEXT_OUTPUT.name, "")))
                    ids = event[c.TOKEN_ID_OUT.name]
                    ids = [int(t) for t in (ids if isinstance(ids, list) else [ids])]
                    lp = tuple(event.get(s.name) for s in c.LOGPROB_OUTPUTS)
                    _add(reply, ids, piece, str(_scalar(event.get(c.ADAPTER_NAME.name, ""))),
                         str(_scalar(event.get(c.FINISH_REASON.name, ""))),
                         None if any(v is None for v in lp) else lp,
                         str(_scalar(event.get(c.ISSUED_SESSION_TOKEN.name, ""))))
                    # as soon as the token arrives: the turn can be cancelled meanwhile
                    self.tokens.learn(request, reply)
                    if on_piece is not None and any(t >= 0 for t in ids):
                        on_piece(piece)
            return reply
        finally:
            conn.close()


def _scalar(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value


def _http_error(raw: bytes) -> str:
    """Error bodies come as JSON, or as one server-sent event (`data: {...}`) from generate_stream."""
    text = raw.decode("utf-8", errors="replace").strip()
    if text.startswith("data:"):
        text = text[5:].strip()
    try:
        return str(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        return text


def cancel_turn(http_url: str, session_id: str, session_token: str | None = None, timeout: float = 30.0,
                action: str = "cancel") -> dict:
    """Ask the server to stop `session_id`'s turn in flight (the `session_control` model); returns its JSON answer.
    `session_token`: the session's token (needed with session_auth on; a client's `SessionTokens.get` has it).

    Clients that drop a stream should call this: Triton does not pass a cancelled stream on to a running step.
    """
    host, _, port = http_url.partition(":")
    conn = http.client.HTTPConnection(host, int(port or 80), timeout=timeout)
    inputs = [{"name": c.SESSION_ID.name, "shape": [1], "datatype": "BYTES", "data": [session_id]},
              # or "end": drop an idle session
              {"name": c.CONTROL_ACTION.name, "shape": [1], "datatype": "BYTES", "data": [action]}]
    if session_token is not None:
        inputs.append({"name": c.CONTROL_TOKEN.name, "shape": [1], "datatype": "BYTES", "data": [session_token]})
    body = {"inputs": inputs}
    try:
        conn.request("POST", f"/v2/models/{c.SESSION_CONTROL.name}/infer", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(_http_error(raw))
        return json.loads(json.loads(raw)["outputs"][0]["data"][0])
    finally:
        conn.close()


def raw_stream_error(grpc_url: str, tensors: list[tuple[str, np.ndarray, str]], timeout: float = 120.0) -> str | None:
    """Send hand-made (name, array, Triton dtype) tensors to the ensemble over a gRPC stream: the first error's message,
    or None. For probing how the server answers malformed requests (a wrong dtype, a missing input)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error))
    inputs = []
    for name, arr, dtype in tensors:
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    client.async_stream_infer(c.ENSEMBLE_NAME, inputs)
    error = results.get(timeout=timeout)
    client.stop_stream()
    client.close()
    return None if error is None else str(error)
