"""Dynamo's preprocessed request (what the OpenAI frontend sends a token-in engine) -> our sampling parameters, and
our finish reasons -> the frontend's."""

from __future__ import annotations

from typing import Any

from tritonserver_backend.decoder_service import FINISH_LENGTH
from tritonserver_backend.sampling import DEFAULT_MAX_TOKENS, SamplingParams


def sampling_params(request: dict[str, Any]) -> SamplingParams:
    """Unset fields take the project's defaults (greedy, seed 0), as the Triton path does."""
    stop = request.get("stop_conditions") or {}
    opts = request.get("sampling_options") or {}

    def pick(name: str, default: float) -> float:
        value = opts.get(name)
        return default if value is None else float(value)

    return SamplingParams(
        max_tokens=int(stop.get("max_tokens") or DEFAULT_MAX_TOKENS),
        temperature=pick("temperature", 0.0), top_p=pick("top_p", 1.0), seed=int(opts.get("seed") or 0),
        stop=tuple(stop.get("stop") or ()), frequency_penalty=pick("frequency_penalty", 0.0),
        presence_penalty=pick("presence_penalty", 0.0), repetition_penalty=pick("repetition_penalty", 1.0))


def params_to_json(p: SamplingParams) -> dict[str, Any]:
    return {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed, "stop": list(p.stop),
            "frequency_penalty": p.frequency_penalty, "presence_penalty": p.presence_penalty,
            "repetition_penalty": p.repetition_penalty, "logprobs": p.logprobs, "top_logprobs": p.top_logprobs}


def params_from_json(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{**d, "stop": tuple(d.get("stop") or ())})


def openai_finish(reason: str) -> str:
    return "length" if reason == FINISH_LENGTH else "stop"
