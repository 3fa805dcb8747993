"""Chat completions with `n` > 1: n choices from one prefill of the conversation.

The conversation is encoded once, by a prefill-only turn (`max_tokens` 0: the session stops at the assistant prompt)
of a fresh session with the earlier messages as `history`; each choice is a session forked from it (`fork_from`, raw
and with no text: nothing is re-encoded) that samples with seed + i and is ended with its turn; the prompt's session
is ended (`session_control` "end") once every choice has run. Each turn goes through the same `ChatService` code as a
single completion (`ChatService.start`, so every sampling parameter, grammar and stop string applies alike), on a
shadow of the service whose stream rewrites the turn request and whose prefix cache is thrown away: n > 1 replies are
not continued as sessions (a later request with one of them as history rebuilds its session). Choices run one after
another (a fork needs its source idle; each choice is one turn in flight). Not with tools (refused).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from openai_frontend import responses as r
from openai_frontend.errors import APIError, bad_request
from openai_frontend.prefix_cache import PrefixCache
from openai_frontend.schemas import ChatRequest
from tritonserver_backend.clients.client import TurnRequest


class _Rewriting:
    """A TritonStream whose turns are rewritten first (everything else passes through)."""

    def __init__(self, stream: Any, rewrite: Callable[[TurnRequest], TurnRequest]) -> None:
        self._stream, self._rewrite = stream, rewrite

    def turn(self, request: TurnRequest) -> AsyncIterator[Any]:
        return self._stream.turn(self._rewrite(request))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _shadow(service: Any, rewrite: Callable[[TurnRequest], TurnRequest]) -> Any:
    shadow = copy.copy(service)
    shadow.stream = _Rewriting(service.stream, rewrite)
    shadow.cache = PrefixCache(service.cache.budget_bytes, service.cache.cost)  # a throwaway: forks are not continued
    return shadow


async def respond(service: Any, chat: ChatRequest, namespace: str, safe: Callable[[Any], Any],
                  headers: Callable[[Any], dict]) -> Any:
    from fastapi.responses import JSONResponse

    from openai_frontend.streaming import ClosingStreamingResponse as StreamingResponse

    if chat.tools.rendered:
        raise bad_request("n > 1 is not supported together with tools", "n")
    holder: dict[str, str] = {}

    def head(turn: TurnRequest) -> TurnRequest:  # the prompt's own prefill-only session
        holder["id"] = turn.session_id
        return dataclasses.replace(turn, max_tokens=0, stream=False, end_session=False, min_tokens=None, seed=None)

    prompt = await safe(_shadow(service, head).start(chat, namespace))
    try:
        await safe(prompt.collect())
        holder["token"], holder["adapter"] = prompt.session_token, prompt.adapter
        seed = chat.seed if chat.seed is not None else 0

        def fork(i: int) -> Callable[[TurnRequest], TurnRequest]:
            def rewrite(turn: TurnRequest) -> TurnRequest:
                return dataclasses.replace(turn, session_id=f"oai-fork-{uuid.uuid4().hex}", new_session=True, text="",
                                           history=None, raw=True, fork_from=holder["id"],
                                           fork_token=holder["token"] or None, seed=seed + i,
                                           end_session=True, adapter=holder["adapter"] or None, session_token=None,
                                           tools=None, turn_messages=None)
            return rewrite

        cid, created = r.completion_id(), int(time.time())
        first = await safe(_shadow(service, fork(0)).start(chat, namespace))
    except BaseException:
        await _end(service, holder)
        raise

    async def answers() -> AsyncIterator[Any]:
        try:
            yield first
            for i in range(1, chat.n):
                yield await safe(_shadow(service, fork(i)).start(chat, namespace))
        finally:
            await _end(service, holder)

    if not chat.stream:
        choices, completion = [], 0
        each = answers()
        try:
            async for i, answer in _indexed(each):
                text = await safe(answer.collect())
                completion += answer.completion_tokens
                choice = r.completion(cid, created, chat.model, text, answer.finish_reason(), answer.adapter, {},
                                      answer.logprobs if chat.logprobs else None)["choices"][0]
                choices.append({**choice, "index": i})
        finally:
            await each.aclose()
        body = {"id": cid, "object": "chat.completion", "created": created, "model": chat.model,
                "adapter": first.adapter, "choices": choices, "usage": r.usage(first.prompt_tokens, completion, 0)}
        return JSONResponse(body, headers=headers(first))

    async def events() -> AsyncIterator[bytes]:
        completion = 0
        each = answers()
        try:
            async for i, answer in _indexed(each):
                yield _sse(_at(r.chunk(cid, created, chat.model, answer.adapter,
                                       {"role": "assistant", "content": ""}), i))
                async for text, entries in answer.deltas():
                    if text or entries:
                        yield _sse(_at(r.chunk(cid, created, chat.model, answer.adapter, {"content": text}, None,
                                               entries if chat.logprobs else None), i))
                completion += answer.completion_tokens
                yield _sse(_at(r.chunk(cid, created, chat.model, answer.adapter, {}, answer.finish_reason()), i))
        except APIError as exc:
            yield _sse(exc.body())
            return
        finally:
            await each.aclose()
        if chat.include_usage:
            yield _sse(r.usage_chunk(cid, created, chat.model, first.adapter,
                                     r.usage(first.prompt_tokens, completion, 0)))
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers(first))


async def _indexed(items: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    i = 0
    async for item in items:
        yield i, item
        i += 1


def _at(chunk: dict, index: int) -> dict:
    chunk["choices"][0]["index"] = index
    return chunk


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode("utf-8")


async def _end(service: Any, holder: dict[str, str]) -> None:
    if "id" not in holder:
        return
    try:
        await asyncio.shield(service.stream.end(holder["id"], holder.get("token") or None))
    except Exception:  # noqa: BLE001 - best effort: the session is evicted eventually either way
        pass
