"""The `POST /v1/chat/completions` body: pydantic checks the types, `ChatRequest.parse` the meaning.

Nothing is silently dropped: `parameters.check` refuses, with a 400 naming it, every parameter the server does not
honour (`n` > 1, tools, log-probabilities, `response_format`, `top_k`, ... and any key it does not know), and
non-text content is refused the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from . import model_ids, parameters
from .errors import APIError, bad_request

MAX_TOKENS_LIMIT = 4096  # tritonserver_backend.sampling.MAX_TOKENS_LIMIT (not imported: it pulls torch)
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20  # the server's top_logprobs bound (tritonserver_backend.contract TOP_LOGPROBS), OpenAI's too
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class MessageIn(BaseModel):
    role: str
    content: str | list[TextPart] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatBody(BaseModel):
    model: str
    messages: list[MessageIn] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)  # extension (vLLM, TensorRT-LLM have it too)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


B = TypeVar("B", bound=BaseModel)
Message = tuple[str, str]  # (role, content) with roles normalised to system / user / assistant


@dataclass(frozen=True)
class ChatRequest:
    model: str
    adapter: str | None  # explicit adapter (None: MoL2 routes)
    messages: tuple[Message, ...]
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    frequency_penalty: float | None
    presence_penalty: float | None
    repetition_penalty: float | None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def earlier(self) -> tuple[Message, ...]:
        """Everything before the new user message: what a reusable session must already hold."""
        return self.messages[:-1]

    @property
    def last(self) -> str:
        return self.messages[-1][1]

    @classmethod
    def parse(cls, raw: bytes) -> "ChatRequest":
        data = _json_object(raw)
        parameters.check(data)
        return cls.from_body(_validate(ChatBody, data))

    @classmethod
    def from_body(cls, body: ChatBody) -> "ChatRequest":
        if body.n != 1:
            raise bad_request("only n=1 is supported", "n")
        try:
            adapter = model_ids.parse(body.model)
        except ValueError:
            raise APIError(404, f"The model '{body.model}' does not exist; model ids are 'mol2' (MoL2 routing), 'mol2:base' "
                                "and 'mol2:<adapter>' (GET /v1/models lists them)", "invalid_request_error", "model_not_found", "model") from None
        messages = tuple(_message(i, m) for i, m in enumerate(body.messages))
        if messages[-1][0] != "user":
            raise bad_request(f"the last message must come from the user, got role '{messages[-1][0]}'", "messages")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > MAX_STOP or any(not s for s in stop):
            raise bad_request(f"stop takes up to {MAX_STOP} non-empty strings", "stop")
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return cls(body.model, adapter, messages, body.stream, bool(body.stream_options and body.stream_options.include_usage),
                   max_tokens, body.temperature, body.top_p, body.seed, stop, body.frequency_penalty, body.presence_penalty,
                   body.repetition_penalty, bool(body.logprobs), body.top_logprobs or 0)


def _message(i: int, m: MessageIn) -> Message:
    role = ROLES.get(m.role)
    if role is None:
        raise bad_request(f"messages[{i}].role '{m.role}' is not supported (system, developer, user, assistant)", f"messages.{i}.role")
    if m.content is None:
        raise bad_request(f"messages[{i}].content is missing", f"messages.{i}.content")
    text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
    return role, text


class TokenizeBody(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[MessageIn] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's; plain text gets no special tokens here either way


@dataclass(frozen=True)
class TokenizeRequest:
    """`POST /tokenize` (vLLM's shape): exactly one of `prompt` (plain text) or `messages` (the chat format)."""

    prompt: str
    messages: list | None  # Message tuples for the chat format, or None for plain text
    add_generation_prompt: bool

    @classmethod
    def parse(cls, raw: bytes) -> "TokenizeRequest":
        from build_engines.data.tokenizer import Message as ChatMessage

        body = _validate(TokenizeBody, _json_object(raw))
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt (plain text) or messages (rendered in the chat format)", "prompt")
        if body.add_special_tokens:
            raise bad_request("add_special_tokens is not supported: plain text never gets control tokens here "
                              "(send messages to get the chat format's)", "add_special_tokens")
        messages = None if body.messages is None else [ChatMessage(*_message(i, m)) for i, m in enumerate(body.messages)]
        return cls(body.prompt or "", messages, body.add_generation_prompt)


def detokenize_request(raw: bytes, vocab_size: int) -> list[int]:
    """`POST /detokenize` {"tokens": [...]}: the ids, each checked against the vocabulary."""
    tokens = _json_object(raw).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("tokens must be a list of integer token ids", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "tokens")
    return tokens


def _json_object(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


def _validate(model: type[B], data: dict) -> B:
    """pydantic's check, its first complaint as a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{where}: {first['msg']}", param=where) from None


class LoraBody(BaseModel):
    """vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` bodies (`description` is ours: what MoL2's
    router reads about the adapter; without it the server takes the adapter folder's own)."""

    lora_name: str = Field(min_length=1)
    lora_path: str | None = None
    description: str | None = None


def lora_request(raw: bytes, load: bool) -> LoraBody:
    body = _validate(LoraBody, _json_object(raw))
    if load and not body.lora_path:
        raise bad_request("lora_path is required: the adapter's folder (PEFT layout) on the server", "lora_path")
    return body
