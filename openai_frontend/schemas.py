"""The `POST /v1/chat/completions` body: pydantic checks the types, `ChatRequest.parse` the meaning.

Nothing is silently dropped: `parameters.check` refuses, with a 400 naming it, every parameter the server does not
honour (`best_of`, beam search, ... and any key it does not know), and
non-text content is refused the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, StrictBool, ValidationError

from openai_frontend import model_ids, parameters
from openai_frontend.errors import APIError, bad_request
from openai_frontend.tool_calls import Tools, extra_of_calls, extra_of_result, message_calls, parse_tools, wire

MAX_TOKENS_LIMIT = 4096  # tritonserver_backend.sampling.sampler.MAX_TOKENS_LIMIT (not imported: it pulls torch)
MAX_STOP = 4
MAX_N = 16  # chat choices per request (chat_choices.py)
MAX_TOP_LOGPROBS = 20  # the server's top_logprobs bound (tritonserver_backend.contract TOP_LOGPROBS), OpenAI's too
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class MessageIn(BaseModel):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (tool_calls.py)
    tool_call_id: str | None = None  # a tool result's call


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
    # sampling and structured outputs (issue 32); the vLLM names are extensions (parameters.py)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    ignore_eos: StrictBool | None = None  # a number is not a bool here (0 is not "false")
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # tool_calls.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


B = TypeVar("B", bound=BaseModel)
Message = tuple[str, ...]  # (role, content) with roles normalised to system / user / assistant / tool; tool parts add a
# third element, their canonical JSON (tool_calls.py), so they are part of the prefix cache's key


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
    top_k: int | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # checked: integer token ids, biases in [-100, 100]
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int | None = None
    ignore_eos: bool = False
    grammar: dict | None = None  # the tensor API's grammar spec (tritonserver_backend/sampling/grammar.py)
    tools: Tools = Tools()  # tools, tool_choice, parallel_tool_calls (tool_calls.py)
    n: int = 1  # choices: n > 1 are forks of one prefill (chat_choices.py)

    @property
    def earlier(self) -> tuple[Message, ...]:
        """Everything before the new user message (or the trailing tool results): what a reusable session must already
        hold."""
        return self.messages[:len(self.messages) - len(self.turn)]

    @property
    def turn(self) -> tuple[Message, ...]:
        """The messages this turn adds: the last user message or, when tool results follow the last assistant message,
        everything after that message (formats may merge tool results and user text into one turn)."""
        k = max((i + 1 for i, m in enumerate(self.messages) if m[0] == "assistant"), default=0)
        tail = self.messages[k:]
        return tail if any(m[0] == "tool" for m in tail) else self.messages[-1:]

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
        if not 1 <= body.n <= MAX_N:
            raise bad_request(f"n must lie in 1..{MAX_N}", "n")
        try:
            adapter = model_ids.parse(body.model)
        except ValueError:
            raise APIError(404, f"The model '{body.model}' does not exist; model ids are 'mol2' (MoL2 routing), "
                                "'mol2:base' and 'mol2:<adapter>' (GET /v1/models lists them)",
                           "invalid_request_error", "model_not_found", "model") from None
        messages = tuple(_message(i, m) for i, m in enumerate(body.messages))
        if messages[-1][0] not in ("user", "tool"):
            raise bad_request("the last message must come from the user (or be a tool result), got role "
                              f"'{messages[-1][0]}'", "messages")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > MAX_STOP or any(not s for s in stop):
            raise bad_request(f"stop takes up to {MAX_STOP} non-empty strings", "stop")
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return cls(body.model, adapter, messages, body.stream,
                   bool(body.stream_options and body.stream_options.include_usage),
                   max_tokens, body.temperature, body.top_p, body.seed, stop, body.frequency_penalty,
                   body.presence_penalty, body.repetition_penalty, bool(body.logprobs), body.top_logprobs or 0,
                   top_k=body.top_k, min_p=body.min_p, logit_bias=_logit_bias(body.logit_bias),
                   stop_token_ids=tuple(body.stop_token_ids or ()), min_tokens=body.min_tokens or None,
                   ignore_eos=bool(body.ignore_eos), grammar=grammar_of(body), tools=_tools(body), n=body.n)


def _tools(body: ChatBody) -> Tools:
    tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tools.forced and grammar_of(body) is not None:
        raise bad_request(f"tool_choice {tools.choice} constrains the reply to a tool call; it cannot be combined with "
                          "a structured output (response_format, guided_*)", "tool_choice")
    return tools


def _logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's logit_bias: token ids as strings -> bias in [-100, 100] ({} asks for nothing)."""
    if not bias:
        return None
    for key, value in bias.items():
        if not key.strip().lstrip("-").isdigit():
            raise bad_request(f"logit_bias: {key!r} is not a token id", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias of token {key} must lie in [-100, 100], got {value:g}", "logit_bias")
    return {str(int(k)): float(v) for k, v in bias.items()}


def grammar_of(body: ChatBody) -> dict | None:
    """The one grammar the request asks for, as the tensor API's spec: response_format (json_object, json_schema),
    or vLLM's guided_json / guided_regex / guided_grammar / guided_choice / structured_outputs. More than one is a
    400."""
    found: list[tuple[str, dict]] = []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", {"type": "json_object"}))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
                raise bad_request('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                                  "response_format")
            schema = spec.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
            found.append(("response_format",
                          {"type": "json_schema", "schema": schema} if schema is not None else {"type": "json_object"}))
        elif kind != "text":
            raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                              "response_format")
    if body.guided_json is not None:
        found.append(("guided_json", {"type": "json_schema", "schema": _schema(body.guided_json, "guided_json")}))
    if body.guided_regex is not None:
        found.append(("guided_regex", {"type": "regex", "pattern": body.guided_regex}))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", {"type": "ebnf", "grammar": body.guided_grammar}))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice(body.guided_choice, "guided_choice")))
    so = body.structured_outputs
    if so:
        given = {k: v for k, v in so.items() if v is not None and v is not False}
        known = {"json", "regex", "grammar", "choice", "json_object"}
        if len(given) != 1 or not set(given) <= known:
            raise bad_request("structured_outputs takes exactly one of json, regex, grammar, choice, json_object",
                              "structured_outputs")
        (key, value), = given.items()
        if key == "json":
            found.append(("structured_outputs",
                          {"type": "json_schema", "schema": _schema(value, "structured_outputs")}))
        elif key in ("regex", "grammar"):
            if not isinstance(value, str):
                raise bad_request(f"structured_outputs.{key} must be a string", "structured_outputs")
            found.append(("structured_outputs",
                          {"type": "regex", "pattern": value} if key == "regex"
                          else {"type": "ebnf", "grammar": value}))
        elif key == "choice":
            found.append(("structured_outputs", _choice(value, "structured_outputs")))
        else:
            found.append(("structured_outputs", {"type": "json_object"}))
    if len(found) > 1:
        raise bad_request(f"ask for one structured output at a time, got {', '.join(k for k, _ in found)}", found[1][0])
    if not found:
        return None
    if body.ignore_eos or body.min_tokens:
        raise bad_request(f"{found[0][0]}: a structured output decides where the reply ends; it cannot be combined "
                          "with ignore_eos or min_tokens", found[0][0])
    from tritonserver_backend.errors import BadRequest
    from tritonserver_backend.sampling.grammar import canonical

    try:
        canonical(json.dumps(found[0][1]))  # the shape the server takes (whether it compiles, the server says)
    except BadRequest as exc:
        raise bad_request(str(exc), found[0][0]) from None
    return found[0][1]


def _schema(value: Any, param: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"{param}: the schema is not valid JSON", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return value


def _choice(choices: Any, param: str) -> dict:
    """A choice among strings as an EBNF grammar: root ::= "a" | "b" (JSON string escapes are EBNF's too)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
    return {"type": "ebnf", "grammar": "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)}


def _message(i: int, m: MessageIn) -> Message:
    role = ROLES.get(m.role)
    if role is None:
        raise bad_request(f"messages[{i}].role '{m.role}' is not supported (system, developer, user, assistant, tool)",
                          f"messages.{i}.role")
    if m.tool_calls and role == "assistant":
        text = ("" if m.content is None else m.content if isinstance(m.content, str)
                else "".join(p.text for p in m.content))
        return role, text, extra_of_calls(message_calls(i, m.tool_calls))
    if m.content is None:
        raise bad_request(f"messages[{i}].content is missing", f"messages.{i}.content")
    text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
    if role == "tool":
        if not m.tool_call_id:
            raise bad_request(f"messages[{i}] (a tool result) needs tool_call_id", f"messages.{i}.tool_call_id")
        return role, text, extra_of_result(m.tool_call_id)
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
        from ced.text.tokenizer import Message as ChatMessage

        body = _validate(TokenizeBody, _json_object(raw))
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt (plain text) or messages (rendered in the chat format)",
                              "prompt")
        if body.add_special_tokens:
            raise bad_request("add_special_tokens is not supported: plain text never gets control tokens here "
                              "(send messages to get the chat format's)", "add_special_tokens")
        messages = None if body.messages is None else [ChatMessage(*m) if len(m) == 2 else wire(m)
                                                       for m in (_message(i, m) for i, m in enumerate(body.messages))]
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
