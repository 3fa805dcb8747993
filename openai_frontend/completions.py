"""`POST /v1/completions`: raw-text completions, `echo` with prompt log-probabilities, and `n` choices of one prompt.

Each prompt runs as a raw session of the tensor API (contract.RAW: the text tokenized as it is, no chat template, no
end-of-turn), ended with its last turn:

- `echo` with `logprobs`, or a prompt sent as token ids: the session starts from <|bos|> alone and the prompt comes as
  `forced_ids`, so the decoder emits every prompt token itself with its log-probability (teacher forcing: one decoder
  step per prompt token), then samples up to `max_tokens` more (0 allowed: scoring only, what lm-evaluation-harness's
  loglikelihood asks with `max_tokens` 1). The first prompt token's log-probability is `null`, as OpenAI shows it.
- otherwise: the prompt is the turn's text, encoded in one prefill, and the reply is sampled after it.
- `n` > 1: the prompt is encoded once, by a turn of its own with `max_tokens` 0 (a prefill-only session that holds the
  prompt), and each choice is a new session forked from it (contract.FORK_FROM): the fork copies the encoder state and
  the decoder's global-KV mirror and replay window, re-encodes nothing, replays the last window under the adapter and
  samples with seed + i. The prompt session is ended (session_control "end") once every choice has run. Choices run
  one after another: a fork needs its source idle, and each is one turn in flight.

Parameters follow the table below (`HONOURED` ...): a parameter the server would drop is refused with a 400 naming it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pydantic import BaseModel, Field

from ced.text.tokenizer import ChatTokenizer
from openai_frontend import model_ids
from openai_frontend.errors import APIError, bad_request
from openai_frontend.parameters import _empty, _is, check_table, rows_of
from openai_frontend.prefix_cache import cache_salt_of
from openai_frontend.schemas import MAX_STOP, MAX_TOKENS_LIMIT, StreamOptions, _json_object, _validate
from openai_frontend.stop_text import StopText
from openai_frontend.triton_stream import Piece
from tritonserver_backend.clients.client import TurnRequest

MAX_LOGPROBS = 20  # the server's top_logprobs bound (OpenAI's completions allow 5)
MAX_N = 16
MAX_PROMPTS = 64

HONOURED = {
    "model": "'mol2' routes with MoL2, 'mol2:base' and 'mol2:<adapter>' choose",
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists (one choice set per prompt); "
              "raw text, no chat template",
    "max_tokens": "0 to the server's limit (default 16); 0 with echo scores the prompt only",
    "temperature": "0 is greedy",
    "top_p": "nucleus sampling",
    "seed": "same seed, same reply; choice i of n uses seed + i",
    "stop": "up to 4 strings, cut from the completion (not matched in an echoed prompt)",
    "frequency_penalty": "OpenAI's definition, in the decoder's sampler",
    "presence_penalty": "OpenAI's definition, in the decoder's sampler",
    "n": f"1 to {MAX_N} choices per prompt from one prefill (each a fork of the prompt's session)",
    "echo": "the prompt is returned before the completion (with its tokens' log-probabilities when logprobs is set)",
    "logprobs": f"0 to {MAX_LOGPROBS}: tokens, token_logprobs, top_logprobs (that many alternatives) and text_offset",
    "stream": "server-sent text_completion chunks ending with [DONE]",
    "stream_options": "include_usage",
}
EXTENSIONS = {"repetition_penalty": "vLLM / TensorRT-LLM's multiplicative penalty"}
NO_EFFECT = {"user": "an end-user id for abuse monitoring"}
REFUSED: dict[str, Any] = {
    "suffix": lambda v: v == "",
    "best_of": _is(1),
    "logit_bias": _empty,
    "top_k": _is(-1, 0),
    "min_p": _is(0, 0.0),
    "prompt_logprobs": _is(0),
    "min_tokens": _is(0),
    "ignore_eos": _is(False),
    "stop_token_ids": _empty,
    "use_beam_search": _is(False),
    "response_format": lambda v: v == {"type": "text"},
    "guided_json": lambda v: False,
    "guided_regex": lambda v: False,
    "guided_choice": lambda v: False,
    "guided_grammar": lambda v: False,
}
REFUSED_WHY = {
    "suffix": "insertion (fill in the middle) is not supported by this model",
    "best_of": "server-side best-of ranking is not implemented; use n and rank the choices' logprobs",
    "prompt_logprobs": "use echo with logprobs (the prompt's tokens then carry their log-probabilities)",
}


def check(data: dict[str, Any]) -> None:
    """Refuse, naming them, the completions parameters this server would otherwise drop."""
    check_table(data, HONOURED, EXTENSIONS, NO_EFFECT, REFUSED, REFUSED_WHY,
                "not supported by this server on completions")


def table_rows() -> list[tuple[str, str, str]]:
    """(parameter, status, what happens) for every completions parameter, as docs/openai.md shows them."""
    return rows_of(HONOURED, EXTENSIONS, NO_EFFECT, REFUSED, REFUSED_WHY)


class CompletionBody(BaseModel):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**62), lt=2**62)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)


@dataclass(frozen=True)
class Prompt:
    text: str | None  # as sent; None for a prompt of token ids
    ids: tuple[int, ...]


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    adapter: str | None
    prompts: tuple[Prompt, ...]
    body: CompletionBody
    stop: tuple[str, ...]
    cache_salt: str | None = None  # the API key's partition of the server's prefix cache (None: shared)

    @property
    def stream(self) -> bool:
        return self.body.stream

    @property
    def include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    @classmethod
    def parse(cls, raw: bytes, tokenizer: ChatTokenizer) -> "CompletionRequest":
        data = _json_object(raw)
        check(data)
        body = _validate(CompletionBody, data)
        try:
            adapter = model_ids.parse(body.model)
        except ValueError:
            raise APIError(404, f"The model '{body.model}' does not exist; model ids are 'mol2' (MoL2 routing), "
                                "'mol2:base' and 'mol2:<adapter>' (GET /v1/models lists them)",
                           "invalid_request_error", "model_not_found", "model") from None
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > MAX_STOP or any(not s for s in stop):
            raise bad_request(f"stop takes up to {MAX_STOP} non-empty strings", "stop")
        return cls(body.model, adapter, _prompts(body.prompt, tokenizer), body, stop)


def _prompts(prompt: Any, tokenizer: ChatTokenizer) -> tuple[Prompt, ...]:
    """The request's prompts: one string, several strings, one list of token ids, or several such lists."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt is empty", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(Prompt(item, tuple(tokenizer.encode(item))))
            continue
        bad = [t for t in item if not 0 <= t < tokenizer.vocab_size]
        if not item or bad:
            raise bad_request(f"prompt[{i}]: token ids must be a non-empty list within the vocabulary [0, "
                              f"{tokenizer.vocab_size})", "prompt")
        out.append(Prompt(None, tuple(item)))
    return tuple(out)


# ---------------------------------------------------------------------------------------------- running the choices
@dataclass
class Delta:
    """A piece of one choice: its text, its tokens' log-probability entries, and its finish reason at the end."""

    index: int
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    finish: str | None = None

    def logprobs(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


@dataclass
class _Choice:
    index: int
    offset: int = 0  # characters of the choice's text so far


@dataclass
class Totals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    adapter: str = ""


FINISH = {"end_of_turn": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


class Completions:
    """Runs a CompletionRequest's choices over the service's TritonStream, as a stream of Deltas."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.tokenizer: ChatTokenizer = service.tokenizer
        self.stream = service.stream
        self._holder_token = ""  # the session token of the prompt's session of n forks (one request per instance)
        self._holder_open = False  # that session exists on the server (its turn answered)

    async def deltas(self, request: CompletionRequest, totals: Totals) -> AsyncIterator[Delta]:
        await self.service.check_model(request)
        n = request.body.n
        for p, prompt in enumerate(request.prompts):
            totals.prompt_tokens += len(prompt.ids)
            if n == 1:
                async for d in self._single(request, prompt, _Choice(p), totals):
                    yield d
            else:
                async for d in self._forked(request, prompt, [_Choice(p * n + j) for j in range(n)], totals):
                    yield d

    def _forced(self, request: CompletionRequest, prompt: Prompt) -> bool:
        return prompt.text is None or (request.body.echo and request.body.logprobs is not None)

    def _turn(self, request: CompletionRequest, session_id: str, **kw: Any) -> TurnRequest:
        b = request.body
        base = dict(new_session=True, adapter=request.adapter, max_tokens=b.max_tokens, temperature=b.temperature,
                    top_p=b.top_p, seed=b.seed, frequency_penalty=b.frequency_penalty,
                    presence_penalty=b.presence_penalty,
                    repetition_penalty=b.repetition_penalty, stream=b.stream, logprobs=b.logprobs is not None,
                    top_logprobs=b.logprobs or None, raw=True, end_session=True, text="",
                    cache_salt=request.cache_salt)
        base.update(kw)
        return TurnRequest(session_id, **base)  # type: ignore[arg-type]

    async def _single(self, request: CompletionRequest, prompt: Prompt, choice: _Choice,
                      totals: Totals) -> AsyncIterator[Delta]:
        sid = f"cmpl-{uuid.uuid4().hex}"
        if self._forced(request, prompt):
            turn = self._turn(request, sid, forced_ids=list(prompt.ids), adapter=await self._route(request, prompt))
            async for d in self._read(request, turn, choice, totals, forced=len(prompt.ids), echo=request.body.echo):
                yield d
            return
        if request.body.echo:
            yield self._echo_text(prompt, choice)
        turn = self._turn(request, sid, text=prompt.text, stop=list(request.stop) or None)
        async for d in self._read(request, turn, choice, totals, forced=0, echo=False):
            yield d

    async def _forked(self, request: CompletionRequest, prompt: Prompt, choices: list[_Choice],
                      totals: Totals) -> AsyncIterator[Delta]:
        """The prompt's own prefill-only session, then one fork of it per choice."""
        holder = f"cmpl-{uuid.uuid4().hex}"
        self._holder_token, self._holder_open = "", False
        forced = self._forced(request, prompt)
        want_echo = request.body.echo
        head = self._turn(request, holder, max_tokens=0, end_session=False, stream=False, seed=None,
                          **({"forced_ids": list(prompt.ids), "adapter": await self._route(request, prompt)}
                             if forced else {"text": prompt.text}))
        echo: list[Delta] = []
        try:
            async for d in self._read(request, head, _Choice(-1), totals, forced=len(prompt.ids) if forced else 0,
                                      echo=want_echo and forced, holder=True):
                echo.append(d)
            token = self._holder_token
            # the holder's adapter
            routed = request.adapter if request.adapter is not None else (totals.adapter or None)
            if want_echo and not forced:
                echo = [self._echo_text(prompt, _Choice(-1))]
            seed = request.body.seed if request.body.seed is not None else 0
            for j, choice in enumerate(choices):
                for d in echo:
                    if d.finish is None:
                        yield _reindexed(d, choice)
                turn = self._turn(request, f"cmpl-{uuid.uuid4().hex}", fork_from=holder, fork_token=token or None,
                                  seed=seed + j, stop=list(request.stop) or None, adapter=routed)
                async for d in self._read(request, turn, choice, totals, forced=0, echo=False):
                    yield d
        finally:
            if self._holder_open:
                await asyncio.shield(self._end_quietly(holder, self._holder_token))

    async def _route(self, request: CompletionRequest, prompt: Prompt) -> str | None:
        """The adapter a forced session runs under. A forced session starts from <|bos|> alone, so MoL2 would route it
        on nothing: a routed request ('mol2') first has the prompt routed by a prefill-only turn of its own text
        (ended at once), and the forced session names the adapter chosen, so echo + logprobs scores the prompt under
        the adapter its completion without logprobs gets. Costs one prefill of the prompt."""
        if request.adapter is not None:
            return request.adapter
        text = prompt.text if prompt.text is not None else self.tokenizer.decode(list(prompt.ids))
        probe = TurnRequest(f"cmpl-route-{uuid.uuid4().hex}", text, new_session=True, raw=True, max_tokens=0,
                            end_session=True, stream=False)
        adapter = ""
        async for piece in self.stream.turn(probe):
            adapter = piece.adapter or adapter
        return adapter or None

    async def _end_quietly(self, session_id: str, token: str) -> None:
        try:
            await self.stream.end(session_id, token or None)
        except Exception:  # noqa: BLE001 - best effort: the session is evicted eventually either way
            pass

    def _echo_text(self, prompt: Prompt, choice: _Choice) -> Delta:
        text = prompt.text if prompt.text is not None else self.tokenizer.decode(list(prompt.ids))
        choice.offset += len(text)
        return Delta(choice.index, text)

    async def _read(self, request: CompletionRequest, turn: TurnRequest, choice: _Choice, totals: Totals, forced: int,
                    echo: bool, holder: bool = False) -> AsyncIterator[Delta]:
        """One turn's pieces as Deltas: its first `forced` tokens are the prompt (shown only with `echo`, the first one
        without a log-probability), the rest the completion, cut at a stop string."""
        stops = StopText(tuple(request.stop))
        seen = 0
        pieces = self.stream.turn(turn)
        finish = ""
        try:
            async for piece in pieces:
                if holder:
                    self._holder_token = piece.session_token or self._holder_token
                    self._holder_open = True
                totals.adapter = piece.adapter or totals.adapter
                delta = Delta(choice.index)
                for k, token_id in enumerate(piece.token_ids):
                    position = seen + k
                    prompt_token = position < forced
                    if prompt_token and not echo:
                        continue
                    text = self.tokenizer.decode([token_id], skip_special=True)
                    if not prompt_token:
                        totals.completion_tokens += 1
                        text = stops.feed(text)
                    self._add(delta, piece, k, token_id, text, choice, first=prompt_token and position == 0)
                seen += len(piece.token_ids)
                if stops.stopped:
                    finish = "stop"
                elif piece.finish:
                    finish = FINISH.get(piece.finish, "stop")
                    tail = stops.flush()
                    delta.text += tail
                    choice.offset += len(tail)
                if delta.text or delta.tokens:
                    yield delta
                if finish:
                    break
        finally:
            await pieces.aclose()
        if not holder:
            yield Delta(choice.index, finish=finish or "stop")

    def _add(self, delta: Delta, piece: Piece, k: int, token_id: int, text: str, choice: _Choice, first: bool) -> None:
        delta.text += text
        if piece.logprobs:
            delta.tokens.append(self.tokenizer.decode([token_id], skip_special=False))
            delta.text_offset.append(choice.offset)
            if first:
                delta.token_logprobs.append(None)
                delta.top_logprobs.append(None)
            else:
                delta.token_logprobs.append(piece.logprobs[k])
                top = piece.top[k] if piece.top else ()
                delta.top_logprobs.append({self.tokenizer.decode([i], skip_special=False): lp for i, lp in top})
        choice.offset += len(text)


def _reindexed(delta: Delta, choice: _Choice) -> Delta:
    choice.offset += len(delta.text)
    return Delta(choice.index, delta.text, list(delta.tokens), list(delta.token_logprobs), list(delta.top_logprobs),
                 list(delta.text_offset))


# ---------------------------------------------------------------------------------------------- response objects
def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(totals: Totals) -> dict:
    return {"prompt_tokens": totals.prompt_tokens, "completion_tokens": totals.completion_tokens,
            "total_tokens": totals.prompt_tokens + totals.completion_tokens}


def gather(request: CompletionRequest, deltas: list[Delta], totals: Totals, cid: str, created: int) -> dict:
    """The non-streamed `text_completion` object from every Delta of every choice."""
    count = len(request.prompts) * request.body.n
    choices = [{"index": i, "text": "", "logprobs": None, "finish_reason": None} for i in range(count)]
    merged = [Delta(i) for i in range(count)]
    for d in deltas:
        m = merged[d.index]
        m.text += d.text
        m.tokens += d.tokens
        m.token_logprobs += d.token_logprobs
        m.top_logprobs += d.top_logprobs
        m.text_offset += d.text_offset
        if d.finish is not None:
            choices[d.index]["finish_reason"] = d.finish
    for choice, m in zip(choices, merged):
        choice["text"] = m.text
        if request.body.logprobs is not None:
            choice["logprobs"] = m.logprobs()
    return {"id": cid, "object": "text_completion", "created": created, "model": request.model,
            "adapter": totals.adapter, "choices": choices, "usage": usage(totals)}


def chunk(request: CompletionRequest, delta: Delta, cid: str, created: int, adapter: str) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": request.model, "adapter": adapter,
            "choices": [{"index": delta.index, "text": delta.text,
                         "logprobs": (delta.logprobs() if request.body.logprobs is not None and delta.finish is None
                                      else None),
                         "finish_reason": delta.finish}]}


def usage_chunk(request: CompletionRequest, totals: Totals, cid: str, created: int) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": request.model, "choices": [],
            "usage": usage(totals)}


def sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode("utf-8")


def now() -> int:
    return int(time.time())


async def respond(service: Any, raw: bytes, safe: Any, namespace: str = "") -> Any:
    """The `/v1/completions` response: one `text_completion` object, or server-sent chunks (the first delta is awaited
    before the response starts, so an error before it keeps its HTTP status). `safe` turns a lost connection to
    tritonserver into a 503 (app._safe). `namespace`: the API key's, whose partition of the prefix cache the
    prompts use."""
    from fastapi.responses import JSONResponse

    from openai_frontend.streaming import ClosingStreamingResponse as StreamingResponse

    request = dataclasses.replace(CompletionRequest.parse(raw, service.tokenizer), cache_salt=cache_salt_of(namespace))
    totals, cid, created = Totals(), completion_id(), now()
    deltas = Completions(service).deltas(request, totals)
    if not request.stream:
        collected = await safe(_collect(deltas))
        return JSONResponse(gather(request, collected, totals, cid, created))
    try:
        first = await safe(anext(deltas))
    except BaseException:
        await deltas.aclose()
        raise

    async def events() -> AsyncIterator[bytes]:
        try:
            yield sse(chunk(request, first, cid, created, totals.adapter))
            async for delta in deltas:
                yield sse(chunk(request, delta, cid, created, totals.adapter))
        except APIError as exc:
            yield sse(exc.body())
            return
        finally:
            await deltas.aclose()
        if request.include_usage:
            yield sse(usage_chunk(request, totals, cid, created))
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _collect(deltas: AsyncIterator[Delta]) -> list[Delta]:
    return [d async for d in deltas]
