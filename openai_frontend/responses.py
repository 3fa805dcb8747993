"""The OpenAI response objects: a chat completion, a streamed chunk, usage, the model list.

Besides the standard fields each completion and chunk carries `adapter` (the LoRA adapter that answered, MoL2's
choice for a routed request); `usage.prompt_tokens_details.cached_tokens` counts the prompt positions the reused
server session already held (0 when the conversation was rebuilt or is new).
"""

from __future__ import annotations

import time
import uuid

OWNER = "mol2-serving"
FINISH = {"end_of_turn": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def finish_reason(server_reason: str) -> str:
    return FINISH.get(server_reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def logprobs(entries: list[dict] | None) -> dict | None:
    """A choice's `logprobs` object (None when the request did not ask for them)."""
    return None if entries is None else {"content": entries, "refusal": None}


def completion(cid: str, created: int, model: str, text: str, finish: str, adapter: str, use: dict,
               entries: list[dict] | None = None, tool_calls: list[dict] | None = None) -> dict:
    """`tool_calls`: the reply's calls (then `content` is None when the reply had no text besides them)."""
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    return {"id": cid, "object": "chat.completion", "created": created, "model": model, "adapter": adapter,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs(entries), "finish_reason": finish}],
            "usage": use}


def chunk(cid: str, created: int, model: str, adapter: str, delta: dict, finish: str | None = None,
          entries: list[dict] | None = None) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "adapter": adapter,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs(entries), "finish_reason": finish}]}


def usage_chunk(cid: str, created: int, model: str, adapter: str, use: dict) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "adapter": adapter,
            "choices": [], "usage": use}


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNER}


def model_list(ids: list[str]) -> dict:
    now = int(time.time())
    return {"object": "list", "data": [model_card(i, now) for i in ids]}
