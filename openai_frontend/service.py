"""One chat completion: which server session answers it, the turn itself, and what the cache learns from it.

A request whose earlier messages are exactly what a cached session holds continues that session: only the new user
message is sent (and encoded). Otherwise it starts a fresh session with `new_session` and the earlier messages as
`history` (the server's rebuild path). Either way the request is the same tensor-API turn a client of the `mol2`
ensemble would send, so the reply is the one that conversation gets there. A cached session the server has meanwhile
evicted fails before anything is encoded and is rebuilt at once; the client never sees it.

The server issues a session token when a session starts (issued_session_token on the turn's responses; with
session_auth on, the default, every later turn and cancel of the session must present it). The frontend keeps it in
the cache entry beside the session id and sends it with each continuing turn; the client never sees it. A turn the
server refuses for its token (a restarted server, a session it forgot) is treated like a lost session: rebuilt at once
from the messages under a new session id, and counted (`refusals`, `rebuilt_after_refusal`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from ced.text.chat_format import ChatFormatError
from ced.text.tokenizer import ChatTokenizer
from openai_frontend import model_ids, responses, tool_calls
from openai_frontend.errors import APIError, bad_request, session_lost, session_refused, unknown_model
from openai_frontend.prefix_cache import Entry, PrefixCache, cache_salt_of, prefix_key
from openai_frontend.schemas import ChatRequest
from openai_frontend.stop_text import StopText
from openai_frontend.triton_stream import Piece, TritonStream
from tritonserver_backend.clients.client import TurnRequest

ADAPTER_LIST_TTL_S = 2.0


@dataclass
class Answer:
    """A turn under way: the first piece is in (so errors before the reply became HTTP errors and the adapter is
    known for the response header); `deltas` streams the reply text and, at its end, records the session."""

    service: "ChatService"
    request: ChatRequest
    session_id: str
    reused: bool
    prompt_tokens: int
    cached_tokens: int
    first: Piece
    rest: AsyncIterator[Piece]
    namespace: str = ""  # the prefix cache's partition (the API key's digest; "" without keys)
    session_token: str = field(default="", repr=False)  # the session's token: the one sent, or the one issued now
    refused: bool = False  # the cached session's token was refused, and this turn rebuilt it
    adapter: str = ""
    finish: str = ""
    completion_tokens: int = 0
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)  # with logprobs: OpenAI's entry per generated token, so far
    # with tools rendered: the reply's text through the tool-call parser (tool_calls.py)
    tools: tool_calls.ToolReply | None = None
    _stop: StopText = field(init=False)

    def __post_init__(self) -> None:
        self.adapter = self.first.adapter
        self._stop = StopText(self.request.stop)

    async def deltas(self) -> AsyncIterator[tuple[str, list[dict]]]:
        """(text, log-probability entries of the tokens that piece brought) as the reply arrives; a piece whose
        text the stop-string check holds back still brings its tokens' entries."""
        complete = False
        try:
            piece = self.first
            while True:
                out = self._take(piece)
                entries = self._entries(piece)
                if out or entries or self._calls_waiting():
                    yield out, entries
                if piece.finish:
                    break
                piece = await anext(self.rest)
            tail = self._tool_text(self._stop.flush(), final=True)
            self.text = self.tools.content if self.tools is not None else self._stop.emitted
            if tail or self._calls_waiting():
                yield tail, []
            complete = True
        finally:
            if not complete:
                await self.rest.aclose()  # the client left: the stream cancels the turn on the server
            else:
                self.service.remember(self)

    def _take(self, piece: Piece) -> str:
        self.session_token = piece.session_token or self.session_token
        self.adapter = piece.adapter or self.adapter
        self.finish = piece.finish or self.finish
        if not piece.token_ids:
            return ""
        self.completion_tokens += len(piece.token_ids)
        return self._tool_text(self._stop.feed(piece.text))

    def _tool_text(self, text: str, final: bool = False) -> str:
        """The reply's content: with tools, what is left of the text once the calls in it are taken out."""
        return text if self.tools is None else self.tools.feed(text, final)

    def _calls_waiting(self) -> bool:
        return self.tools is not None and self.tools.waiting

    @property
    def tool_calls(self) -> list[dict]:
        """The reply's tool calls as OpenAI's message shows them ([] without)."""
        return self.tools.message_calls() if self.tools is not None else []

    def finish_reason(self) -> str:
        """OpenAI's finish_reason: "tool_calls" when the reply made calls, else the server's reason mapped."""
        return "tool_calls" if self.tool_calls else responses.finish_reason(self.finish)

    def _entries(self, piece: Piece) -> list[dict]:
        """OpenAI's `logprobs.content` entries for the piece's tokens (empty unless the request asked for them)."""
        if not self.request.logprobs or len(piece.logprobs) != len(piece.token_ids):
            return []
        tokenizer = self.service.tokenizer
        entries = [{**_token(tokenizer, t, lp),
                    "top_logprobs": [_token(tokenizer, i, x) for i, x in top][:self.request.top_logprobs]}
                   for t, lp, top in zip(piece.token_ids, piece.logprobs, piece.top or ((),) * len(piece.token_ids))]
        self.logprobs.extend(entries)
        return entries

    async def collect(self) -> str:
        return "".join([text async for text, _ in self.deltas()])


def _token(tokenizer: ChatTokenizer, token_id: int, logprob: float) -> dict:
    """One token as OpenAI's logprobs show it: its text, its log-probability and the UTF-8 bytes of that text."""
    text = tokenizer.decode([token_id], skip_special=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class ChatService:
    def __init__(self, stream: TritonStream, tokenizer: ChatTokenizer, cache: PrefixCache,
                 max_model_len: int = 8192, constrain_auto_calls: bool = True) -> None:
        """`max_model_len`: the server's max_context (what /tokenize reports). `constrain_auto_calls`: with
        tool_choice auto, a call the model begins is held to the offered tools' schemas (`Tools.auto_grammar`)."""
        self.stream, self.tokenizer, self.cache = stream, tokenizer, cache
        self.max_model_len = max_model_len
        self.constrain_auto_calls = constrain_auto_calls
        self._adapters: list[str] = []
        self._adapters_at = 0.0
        self.reused = self.rebuilt = self.started = 0
        # continuing turns the server refused for their session token, and cached sessions rebuilt because the server
        # refused their token or had lost them (evicted, ended): what /metrics reports
        self.refusals = self.rebuilt_after_refusal = self.rebuilt_after_loss = 0

    def session_counts(self) -> dict[str, int]:
        """What /metrics reports of refused session tokens and rebuilt sessions."""
        return {"refusals": self.refusals, "rebuilt_after_refusal": self.rebuilt_after_refusal,
                "rebuilt_after_loss": self.rebuilt_after_loss}

    # ------------------------------------------------------------------ models
    async def adapters(self, fresh: bool = False) -> list[str]:
        if fresh or time.monotonic() - self._adapters_at > ADAPTER_LIST_TTL_S:
            self._adapters = await self.stream.adapters()
            self._adapters_at = time.monotonic()
        return self._adapters

    async def models(self) -> list[str]:
        return model_ids.served(await self.adapters())

    async def check_model(self, request: ChatRequest) -> None:
        adapter = request.adapter
        if adapter is None or adapter == model_ids.BASE:
            return
        if adapter not in await self.adapters() and adapter not in await self.adapters(fresh=True):
            raise unknown_model(request.model, model_ids.served(self._adapters))

    # ------------------------------------------------------------------ a completion
    async def start(self, request: ChatRequest, namespace: str = "") -> Answer:
        """`namespace`: the prefix cache partition of the request's API key (`prefix_cache.namespace_of`)."""
        await self.check_model(request)
        tools = request.tools
        syntax = tool_calls.syntax_for(self.tokenizer.chat_format) if tools.rendered else None
        if syntax is not None and tools.forced:
            request = dataclasses.replace(request, grammar=tools.grammar(syntax))
        elif syntax is not None and request.grammar is None and self.constrain_auto_calls:
            request = dataclasses.replace(request, grammar=tools.auto_grammar(syntax))
        salt = cache_salt_of(namespace)  # the API key's partition of the server's prefix cache
        namespace = tools.namespace(namespace)  # a session holds the tools' text: the cache keys on the tools too
        try:  # counted in the model directory's chat format, the one the server renders the turn in
            prompt_tokens = len(self.tokenizer.chat_format.encode(
                [tool_calls.wire(m) for m in request.messages],
                tools=list(tools.definitions) if tools.rendered else None))
        except ChatFormatError as exc:
            raise bad_request(str(exc), "messages") from None
        answer = await self._answer(request, namespace, prompt_tokens, salt)
        if syntax is not None:
            answer.tools = tool_calls.ToolReply(syntax, tools.parallel and not tools.forced)
        return answer

    async def _answer(self, request: ChatRequest, namespace: str, prompt_tokens: int,
                      salt: str | None = None) -> Answer:
        entry = self.cache.take(prefix_key(request.earlier, namespace)) if request.earlier else None
        refused = False
        if entry is not None:
            try:
                return await self._open(request, namespace, entry.session_id, False, prompt_tokens, entry.tokens,
                                        entry.session_token, salt)
            except APIError as exc:
                if not session_lost(exc):
                    raise
                refused = session_refused(exc)
                self.refusals += refused
        answer = await self._open(request, namespace, f"oai-{uuid.uuid4().hex}", True, prompt_tokens, 0, "", salt)
        answer.refused = refused
        if entry is not None:
            self.rebuilt_after_refusal += refused
            self.rebuilt_after_loss += not refused
        return answer

    async def _open(self, request: ChatRequest, namespace: str, session_id: str, new: bool, prompt_tokens: int,
                    cached: int, session_token: str = "", salt: str | None = None) -> Answer:
        history = (json.dumps([tool_calls.wire(m) for m in request.earlier], ensure_ascii=False)
                   if new and request.earlier else None)
        plain = len(request.turn) == 1 and request.turn[0][0] == "user"  # the tensor API's text; else turn_messages
        turn_messages = None if plain else json.dumps([tool_calls.wire(m) for m in request.turn], ensure_ascii=False)
        turn = TurnRequest(session_id, request.last if plain else "", new_session=new, adapter=request.adapter,
                           max_tokens=request.max_tokens,
                           temperature=request.temperature, top_p=request.top_p, seed=request.seed,
                           stop=list(request.stop) or None, frequency_penalty=request.frequency_penalty,
                           presence_penalty=request.presence_penalty, repetition_penalty=request.repetition_penalty,
                           history=history, stream=request.stream, logprobs=request.logprobs,
                           # a non-streamed completion: one response, not one per token
                           top_logprobs=request.top_logprobs or None,
                           session_token=session_token or None, top_k=request.top_k, min_p=request.min_p,
                           logit_bias=request.logit_bias, stop_token_ids=list(request.stop_token_ids) or None,
                           min_tokens=request.min_tokens, ignore_eos=request.ignore_eos, grammar=request.grammar,
                           tools=request.tools.json(), turn_messages=turn_messages, cache_salt=salt)
        pieces = self.stream.turn(turn)
        try:
            first = await anext(pieces)
        except BaseException:
            await pieces.aclose()
            raise
        if new:
            self.rebuilt += bool(request.earlier)
            self.started += not request.earlier
        else:
            self.reused += 1
        return Answer(self, request, session_id, not new, prompt_tokens, cached, first, pieces, namespace,
                      first.session_token or session_token)

    def remember(self, answer: Answer) -> None:
        """The session now holds the request's messages and the reply as returned: continuable under that prefix."""
        if answer.finish == "cancelled":
            return
        reply = ("assistant", answer.text, answer.tools.extra()) if answer.tool_calls else ("assistant", answer.text)
        held = answer.request.messages + (reply,)
        tokens = answer.prompt_tokens + answer.completion_tokens + 1  # + the end-of-turn the server appends
        self.cache.put(prefix_key(held, answer.namespace), Entry(answer.session_id, tokens, answer.session_token))
