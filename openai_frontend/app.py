"""The FastAPI application: `/v1/chat/completions`, `/v1/models`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`,
`/tokenize`, `/detokenize`, `/metrics` (Prometheus), `/health`, errors in the OpenAI format, and with API keys every
route but `/health` and `/metrics` behind `Authorization: Bearer <key>` (as vLLM guards its API, not its scrape).
With several keys (one per tenant) the conversation-prefix cache is partitioned by the key a request presented, so the
same messages sent under two keys never continue the same server session.

Streaming answers are server-sent events of `chat.completion.chunk` objects ending with `data: [DONE]`. The first
token is awaited before the response starts, so an error before the reply (bad parameter, unknown adapter, busy
server) still gets its HTTP status, and the routed adapter can travel as the `x-mol2-adapter` header as well as in
every chunk. An error after the reply started is sent as an `error` event (the status line is gone by then).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from openai_frontend import responses as r
from openai_frontend.admission import DEFAULT_PER_KEY, KeyAdmission
from openai_frontend.errors import APIError, unavailable
from openai_frontend.metrics import CONTENT_TYPE, FrontendMetrics
from openai_frontend.prefix_cache import namespace_of
from openai_frontend.schemas import ChatRequest, TokenizeRequest, detokenize_request, lora_request
from openai_frontend.service import Answer, ChatService
from openai_frontend.streaming import ClosingStreamingResponse as StreamingResponse
from openai_frontend.tool_calls import stream_deltas

ADAPTER_HEADER = "x-mol2-adapter"
OPEN_ROUTES = ("/health", "/metrics")  # answered without the API key
# tritonserver_backend.auth.admin_auth.ADMIN_KEY_HEADER, forwarded as the server reads it
ADMIN_KEY_HEADER = "mol2-admin-key"
REUSED_HEADER = "x-mol2-session-reused"
CACHED_HEADER = "x-mol2-cached-tokens"


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode("utf-8")


def _headers(answer: Answer) -> dict[str, str]:
    return {ADAPTER_HEADER: answer.adapter, REUSED_HEADER: "true" if answer.reused else "false",
            CACHED_HEADER: str(answer.cached_tokens)}


def _released_after_body(response: Response, release: Callable[[], None]) -> Response:
    """`response` whose `release` runs once its body has been sent (a streamed reply holds its key's slot until its
    last event), or at once for a response without a streamed body."""
    body = getattr(response, "body_iterator", None)
    if body is None:
        release()
        return response

    async def sent_then_released() -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            release()

    response.body_iterator = sent_then_released()  # type: ignore[attr-defined]
    return response


def key_checker(api_keys: Sequence[str]) -> Callable[[str], str | None]:
    """A check of an `Authorization` header against every key: the namespace (`prefix_cache.namespace_of`) of the
    key it presents as `Bearer <key>`, or None. The presented key's SHA-256 is compared with every key's in constant
    time (`hmac.compare_digest`, every key compared, no early exit), so timing reveals neither how much of a guess was
    right, nor its length, nor which key matched."""
    digests = [namespace_of(k) for k in dict.fromkeys(api_keys)]
    if not digests or any(not k for k in api_keys):
        raise ValueError("API keys must be non-empty strings")

    def check(header: str) -> str | None:
        raw = header.encode("latin-1", "replace")  # the header's bytes as sent (Starlette decodes them as latin-1)
        presented = raw[len(b"Bearer "):] if raw.startswith(b"Bearer ") else b""
        given = hashlib.sha256(presented).hexdigest()
        matched = None
        for digest in digests:
            if hmac.compare_digest(given, digest):
                matched = digest
        return matched

    return check


def create_app(service: ChatService, api_keys: str | Sequence[str] | None = None,
               per_key_in_flight: int = DEFAULT_PER_KEY) -> FastAPI:
    """`api_keys`: when set (one key or several), every route but `/health` and `/metrics` needs `Authorization: Bearer
    <key>` with one of them (vLLM's `--api-key`; see `key_checker`), and each key has its own partition of the prefix
    cache and at most `per_key_in_flight` requests in flight (admission.py; 0: no bound). None or empty: no
    authentication, one partition."""
    metrics = FrontendMetrics(service.session_counts)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await service.stream.close()

    app = FastAPI(title="mol2 OpenAI-compatible frontend", lifespan=lifespan)
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        metrics.errors.labels(exc.type, exc.code or "").inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.errors.labels("invalid_request_error", "").inc()
        return JSONResponse(APIError(exc.status_code, str(exc.detail), "invalid_request_error").body(),
                            status_code=exc.status_code)

    keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or ())
    admission = KeyAdmission(per_key_in_flight)
    app.state.admission = admission
    if keys:
        check = key_checker(keys)

        @app.middleware("http")
        async def require_key(request: Request, call_next):  # type: ignore[no-untyped-def]
            namespace = check(request.headers.get("authorization", ""))
            request.state.cache_namespace = namespace or ""
            if request.url.path in OPEN_ROUTES:
                return await call_next(request)
            if namespace is None:
                error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                 "invalid_request_error", "invalid_api_key")
                metrics.errors.labels(error.type, error.code or "").inc()
                return JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            if not admission.acquire(namespace):
                error = APIError(429, f"too many requests in flight for this API key (at most "
                                      f"{admission.limit}); retry when one of them has finished",
                                 "rate_limit_error", "key_busy")
                metrics.errors.labels(error.type, error.code or "").inc()
                return JSONResponse(error.body(), status_code=429, headers=error.headers)
            try:
                response = await call_next(request)
            except BaseException:
                admission.release(namespace)
                raise
            return _released_after_body(response, lambda: admission.release(namespace))

    @app.middleware("http")  # added last, so outermost: it counts the key check's 401s too
    async def count_requests(request: Request, call_next):  # type: ignore[no-untyped-def]
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.requests.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> Response:
        if not await service.stream.ready():
            raise unavailable(f"tritonserver at {service.stream.url} is not ready")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(r.model_list(await _safe(service.models())))

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> JSONResponse:
        known = await _safe(service.models())
        if model_id not in known:
            raise APIError(404, f"The model '{model_id}' does not exist", "invalid_request_error",
                           "model_not_found", "model")
        return JSONResponse(r.model_card(model_id, int(time.time())))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's `/tokenize`: a `prompt` as plain text, or `messages` rendered in the model's chat format."""
        body = TokenizeRequest.parse(await request.body())
        tokens = service.tokenizer.encode(body.prompt) if body.messages is None else service.tokenizer.chat(
            body.messages, add_generation_prompt=body.add_generation_prompt)
        return JSONResponse({"count": len(tokens), "max_model_len": service.max_model_len, "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        tokens = detokenize_request(await request.body(), service.tokenizer.vocab_size)
        return JSONResponse({"prompt": service.tokenizer.decode(tokens, skip_special=False)})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        """vLLM's dynamic adapter route, forwarded to `adapter_admin` load with the caller's `mol2-admin-key` header:
        the server checks the key, the allowed folders and the bounds (docs/admin.md)."""
        body = lora_request(await request.body(), load=True)
        result = await _safe(service.stream.administer("load", body.lora_name, request.headers.get(ADMIN_KEY_HEADER),
                                                       body.lora_path or "", body.description or ""))
        await service.adapters(fresh=True)
        return JSONResponse(result)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body = lora_request(await request.body(), load=False)
        result = await _safe(service.stream.administer("unload", body.lora_name, request.headers.get(ADMIN_KEY_HEADER)))
        await service.adapters(fresh=True)
        return JSONResponse(result)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        received = time.perf_counter()
        chat = ChatRequest.parse(await request.body())
        if chat.n > 1:  # n choices from one prefill: forks of the prompt's session (chat_choices.py)
            from openai_frontend.chat_choices import respond as choices

            return await choices(service, chat, getattr(request.state, "cache_namespace", ""), _safe, _headers)
        answer = await _safe(service.start(chat, getattr(request.state, "cache_namespace", "")))
        first = time.perf_counter()
        metrics.ttft.observe(first - received)
        metrics.sessions.labels("reused" if answer.reused else "rebuilt" if chat.earlier else "new").inc()

        def completed() -> None:
            metrics.completed(answer.prompt_tokens, answer.cached_tokens, answer.completion_tokens, received, first,
                              time.perf_counter())

        cid, created = r.completion_id(), int(time.time())
        if not chat.stream:
            text = await _safe(answer.collect())
            completed()
            use = r.usage(answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens)
            return JSONResponse(r.completion(cid, created, chat.model, text, answer.finish_reason(), answer.adapter,
                                             use, answer.logprobs if chat.logprobs else None, answer.tool_calls),
                                headers=_headers(answer))
        return StreamingResponse(_events(chat, answer, cid, created, metrics, completed),
                                 media_type="text/event-stream", headers=_headers(answer))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """Raw-text completions, echo with prompt log-probabilities, n choices from one prefill (completions.py)."""
        from openai_frontend.completions import respond

        return await respond(service, await request.body(), _safe, getattr(request.state, "cache_namespace", ""))

    return app


async def _events(chat: ChatRequest, answer: Answer, cid: str, created: int, metrics: FrontendMetrics,
                  completed: Callable[[], None]) -> AsyncIterator[bytes]:
    yield _sse(r.chunk(cid, created, chat.model, answer.adapter, {"role": "assistant", "content": ""}))
    try:
        async for text, entries in answer.deltas():
            if text or entries:
                yield _sse(r.chunk(cid, created, chat.model, answer.adapter, {"content": text}, None,
                                   entries if chat.logprobs else None))
            for index, call_id, call in answer.tools.take() if answer.tools is not None else ():
                # tool_calls.py: id, type and name, then the arguments
                for delta in stream_deltas(index, call_id, call):
                    yield _sse(r.chunk(cid, created, chat.model, answer.adapter, delta))
    except APIError as exc:
        metrics.errors.labels(exc.type, exc.code or "").inc()
        yield _sse(exc.body())
        return
    completed()
    yield _sse(r.chunk(cid, created, chat.model, answer.adapter, {}, answer.finish_reason()))
    if chat.include_usage:
        yield _sse(r.usage_chunk(cid, created, chat.model, answer.adapter,
                                 r.usage(answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens)))
    yield b"data: [DONE]\n\n"


async def _safe(awaitable):  # type: ignore[no-untyped-def]
    """Await, turning a lost connection to tritonserver into a 503 (other APIErrors pass as they are)."""
    try:
        return await awaitable
    except APIError:
        raise
    except (ConnectionError, OSError) as exc:
        raise unavailable(f"tritonserver is not reachable: {exc}") from None
