"""Dynamo's preprocessed request (what the OpenAI frontend sends a token-in engine) -> our sampling parameters, and
our finish reasons -> the frontend's.

Dynamo's frontend turns the OpenAI request into `sampling_options` (temperature, top_p, top_k, min_p, penalties, seed,
logit_bias, n, and `guided_decoding` from response_format / vLLM's guided_* / tool_choice), `stop_conditions`
(max_tokens, stop, stop_token_ids, min_tokens, ignore_eos; `stop_token_ids_hidden` are the model's own end tokens,
which end a turn here anyway) and `output_options` (`logprobs`: the top_logprobs count when the client asked for
logprobs; `prompt_logprobs`: completions' echo, served by the encoder worker). Each is honoured as the single-server
path honours it, and the annotation `mol2-speculative:off` as its per-request `speculative` false; what this path
cannot do (best_of, two constraints at once) is refused with the reason, never dropped.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ced.text.tool_parsers import ToolSyntax
from dynamo_deploy.tool_choice import native_constraint, tool_call_tag
from tritonserver_backend.core.decoder_service import FINISH_LENGTH
from tritonserver_backend.errors import BadRequest
from tritonserver_backend.sampling.grammar import canonical
from tritonserver_backend.sampling.sampler import DEFAULT_MAX_TOKENS, SamplingParams

# an `nvext.annotations` entry: this turn is never drafted (the Triton path's per-request `speculative` false), what a
# client uses to compare drafting with plain decoding on one deployment
SPECULATIVE_ANNOTATION = "mol2-speculative:"
SPECULATIVE_OFF = SPECULATIVE_ANNOTATION + "off"
MAX_CHOICES = 16  # n per request, as the project's OpenAI frontend allows


def sampling_params(request: dict[str, Any], tool_syntax: ToolSyntax | None = None) -> SamplingParams:
    """Unset fields take the project's defaults (greedy, seed 0), as the Triton path does. `tool_syntax`: how the
    model writes tool calls (a tool_choice's structural tag is enforced in it, tool_choice.py)."""
    stop = request.get("stop_conditions") or {}
    opts = request.get("sampling_options") or {}

    def pick(name: str, default: float) -> float:
        value = opts.get(name)
        return default if value is None else float(value)

    notes = [n for n in request.get("annotations") or () if isinstance(n, str) and n.startswith(SPECULATIVE_ANNOTATION)]
    if any(n != SPECULATIVE_OFF for n in notes):
        raise BadRequest(f"the only {SPECULATIVE_ANNOTATION} annotation is {SPECULATIVE_OFF!r} (this turn is never "
                         f"drafted); got {notes}")
    out = request.get("output_options") or {}
    top = out.get("logprobs")
    choices_of(request)  # n is checked here, served by the encoder worker (forks of one prefill)
    return SamplingParams(
        max_tokens=int(stop.get("max_tokens") or DEFAULT_MAX_TOKENS),
        temperature=pick("temperature", 0.0), top_p=pick("top_p", 1.0), seed=int(opts.get("seed") or 0),
        stop=tuple(stop.get("stop") or ()), frequency_penalty=pick("frequency_penalty", 0.0),
        presence_penalty=pick("presence_penalty", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
        top_k=max(0, int(opts.get("top_k") or 0)), min_p=pick("min_p", 0.0),
        logit_bias=tuple((int(k), float(v)) for k, v in (opts.get("logit_bias") or {}).items()),
        stop_token_ids=tuple(int(t) for t in stop.get("stop_token_ids") or ()),
        min_tokens=int(stop.get("min_tokens") or 0), ignore_eos=bool(stop.get("ignore_eos") or False),
        grammar=grammar_of(opts.get("guided_decoding"), tool_syntax), speculative=not notes,
        logprobs=top is not None, top_logprobs=int(top or 0))


def echoes(request: dict[str, Any]) -> bool:
    """Whether a completions request asks for its prompt back (`echo`: Dynamo's frontend sets prompt_logprobs)."""
    return (request.get("output_options") or {}).get("prompt_logprobs") is not None


def choices_of(request: dict[str, Any]) -> int:
    """The request's `n` (Dynamo passes it once and expects each choice's chunks tagged with its `index`)."""
    opts = request.get("sampling_options") or {}
    n = int(opts.get("n") or 1)
    if not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must lie in 1..{MAX_CHOICES}, got {n}")
    if (opts.get("best_of") or n) != n:
        raise BadRequest("best_of is not served (each of the n choices is returned)")
    return n


def grammar_of(guided: dict[str, Any] | None, tool_syntax: ToolSyntax | None = None) -> str:
    """Dynamo's `guided_decoding` (json / regex / choice / grammar / structural_tag) as our grammar spec ("" for
    none). The structural tag the frontend makes of a tool_choice is enforced in the model's own call syntax
    (tool_choice.py); any other structural tag as sent."""
    if not guided:
        return ""
    kinds = ("json", "regex", "choice", "grammar", "structural_tag")
    given = {k: guided[k] for k in kinds if guided.get(k) is not None}
    if len(given) > 1:
        raise BadRequest(f"one structured-output constraint at a time, got {', '.join(sorted(given))}")
    if not given:
        return ""
    kind, value = next(iter(given.items()))
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        spec: dict[str, Any] = {"type": "json_schema", "schema": schema} if schema else {"type": "json_object"}
    elif kind == "choice":
        import re

        spec = {"type": "regex", "pattern": "(" + "|".join(re.escape(str(c)) for c in value) + ")"}
    elif kind == "structural_tag":
        tag = json.loads(value) if isinstance(value, str) else value
        tool_tag = tool_call_tag(tag)
        if tool_tag is not None:
            native = native_constraint(*tool_tag, tool_syntax)
            return canonical(json.dumps(native)) if native is not None else ""
        if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
            raise BadRequest('a structural_tag constraint needs "format": an xgrammar structural tag format object')
        spec = {"type": "structural_tag", "format": tag["format"]}
    elif kind == "regex":
        spec = {"type": "regex", "pattern": value}
    else:
        spec = {"type": "ebnf", "grammar": value}
    return canonical(json.dumps(spec))


def params_to_json(p: SamplingParams) -> dict[str, Any]:
    """Every field, so the decoder worker samples as the encoder worker read the request."""
    return dataclasses.asdict(p)


def params_from_json(d: dict[str, Any]) -> SamplingParams:
    tuples = {"stop": tuple, "forced_ids": tuple, "stop_token_ids": tuple,
              "logit_bias": lambda v: tuple(tuple(e) for e in v)}
    return SamplingParams(**{k: tuples[k](v) if k in tuples and v is not None else v for k, v in d.items()})


def openai_finish(reason: str) -> str:
    return "length" if reason == FINISH_LENGTH else "stop"
