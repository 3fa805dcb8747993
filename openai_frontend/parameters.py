"""Every chat-completions parameter a client may send, and what this server does with it: no silent drops.

Why a table: OpenAI-compatible servers differ most in what they quietly ignore. A client that asked for JSON
(`response_format`), for `top_k` or for a `logit_bias` and got a plain reply cannot tell; so a parameter the server
does not honour is refused with a 400 that names it, unless its value asks for nothing (`best_of: 1`,
`functions: []`, `bad_words: []`, ...), which is what the server does anyway. A key in no
list (a typo, a parameter of another server) is refused too, as OpenAI's own API refuses it. `null` means absent.
`docs/openai.md` shows this table; a test keeps the two the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from openai_frontend.errors import bad_request

HONOURED = {
    "model": "'mol2' routes with MoL2, 'mol2:base' and 'mol2:<adapter>' choose",
    "messages": "system, developer (as system), user, assistant (with tool_calls), tool; text content parts",
    "stream": "server-sent chunks ending with [DONE]",
    "stream_options": "include_usage",
    "max_tokens": "1 to the server's limit",
    "max_completion_tokens": "wins over max_tokens",
    "temperature": "0 is greedy",
    "top_p": "nucleus sampling",
    "seed": "same seed, same reply",
    "stop": "up to 4 strings, cut from the reply",
    "frequency_penalty": "OpenAI's definition, in the decoder's sampler",
    "presence_penalty": "OpenAI's definition, in the decoder's sampler",
    "n": "1 to 16 choices from one prefill (forks of the prompt's session; not with tools)",
    "logprobs": "each generated token's log-probability under the model (before penalties and temperature)",
    "top_logprobs": "0 to 20 alternatives per token (needs logprobs)",
    "tools": "functions, rendered into the prompt by the model's chat format; calls parsed back into tool_calls",
    "tool_choice": "none, auto, required or a named function; required and named force one call (grammar from its "
                   "schema)",
    "parallel_tool_calls": "false keeps only the first call of an auto reply (a forced reply holds one call)",
    "logit_bias": "token id (a string) -> bias in [-100, 100], added to the logits before sampling (greedy too)",
    "response_format": "text, json_object, json_schema (its schema; strict or not): the decoder samples only what the "
                       "grammar allows (xgrammar), compact JSON",
}
EXTENSIONS = {
    "repetition_penalty": "vLLM / TensorRT-LLM's multiplicative penalty",
    "top_k": "vLLM's: sample among the k most likely tokens (0 or -1: all)",
    "min_p": "vLLM's: drop tokens less likely than min_p x the most likely one",
    "stop_token_ids": "vLLM's: sampling one ends the reply (finish_reason stop; the token is not in the reply)",
    "min_tokens": "vLLM's: end-of-turn and stop_token_ids masked until this many tokens (not with a grammar)",
    "ignore_eos": "vLLM's: end-of-turn never sampled, the reply runs to max_tokens (not with a grammar)",
    "guided_json": "vLLM's: a JSON schema (object or string) the reply follows, as response_format json_schema",
    "guided_regex": "vLLM's: a regular expression the whole reply matches",
    "guided_grammar": "vLLM's: an EBNF grammar (xgrammar's, root rule `root`) the reply follows",
    "guided_choice": "vLLM's: the reply is exactly one of these strings",
    "structured_outputs": "vLLM's: one of json, regex, grammar, choice, json_object",
}
NO_EFFECT = {  # accepted and recorded nowhere: they never change a reply
    "user": "an end-user id for abuse monitoring",
    "safety_identifier": "user's successor",
    "metadata": "stored-completion tags; nothing is stored",
    "prompt_cache_key": "the prefix cache keys on the messages themselves",
}


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == a and type(value) is type(a) for a in allowed)


def _empty(value: Any) -> bool:
    return value in ([], {}, "")


# refused unless the value asks for nothing; the predicate says which values those are
REFUSED: dict[str, Callable[[Any], bool]] = {
    "functions": _empty,
    "function_call": _is("none"),
    "audio": lambda v: False,
    "modalities": lambda v: v == ["text"],
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
    "reasoning_effort": lambda v: False,
    "verbosity": lambda v: False,
    "service_tier": _is("auto", "default"),
    "store": _is(False),
    # other servers' extensions (vLLM, SGLang)
    "best_of": _is(1),
    "use_beam_search": _is(False),
    "length_penalty": _is(1, 1.0),
    "echo": _is(False),
    "prompt_logprobs": _is(0),
    "guided_decoding_backend": _is("xgrammar", "auto"),  # what the server uses anyway
    "bad_words": _empty,
    "allowed_token_ids": lambda v: False,
    "logits_processors": _empty,
    "include_stop_str_in_output": _is(False),
    "skip_special_tokens": _is(True),
    "add_generation_prompt": _is(True),
    "continue_final_message": _is(False),
    "chat_template": lambda v: False,
    "chat_template_kwargs": _empty,
    "truncate_prompt_tokens": lambda v: False,
    "priority": _is(0),
}
REFUSED_WHY = {
    "functions": "the deprecated function calling: send tools",
    "function_call": "the deprecated function calling: send tool_choice",
}


def check_table(data: dict[str, Any], honoured: dict, extensions: dict, no_effect: dict, refused: dict,
                why: dict[str, str], default_reason: str) -> None:
    """Refuse, naming them, the keys of `data` a table (chat's here, completions' in completions.py) does not honour."""
    unknown, bad = [], []
    for key, value in data.items():
        if value is None or key in honoured or key in extensions or key in no_effect:
            continue
        if key not in refused:
            unknown.append(key)
        elif not refused[key](value):
            bad.append(key)
    if bad:
        reasons = "; ".join(f"{k}: {why.get(k, default_reason)}" for k in bad)
        raise bad_request(f"unsupported parameter{'s' if len(bad) > 1 else ''} {', '.join(bad)} ({reasons}); "
                          "docs/openai.md lists every parameter and what the server does with it", bad[0])
    if unknown:
        raise bad_request(f"unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: "
                          f"{', '.join(unknown)}",
                          unknown[0])


def rows_of(honoured: dict, extensions: dict, no_effect: dict, refused: dict,
            why: dict[str, str]) -> list[tuple[str, str, str]]:
    """(parameter, status, what happens) for every parameter of a table, as docs/openai.md shows them."""
    rows = [(k, "honoured", v) for k, v in honoured.items()]
    rows += [(k, "extension", v) for k, v in extensions.items()]
    rows += [(k, "accepted, no effect", v) for k, v in no_effect.items()]
    rows += [(k, "refused (400)", why.get(k, "not supported")) for k in refused]
    return rows


def check(data: dict[str, Any]) -> None:
    """Refuse, naming them, the parameters this server would otherwise drop; returns when every key is honoured."""
    check_table(data, HONOURED, EXTENSIONS, NO_EFFECT, REFUSED, REFUSED_WHY, "not supported by this server")


def table_rows() -> list[tuple[str, str, str]]:
    """(parameter, status, what happens) for every parameter, as docs/openai.md shows them."""
    return rows_of(HONOURED, EXTENSIONS, NO_EFFECT, REFUSED, REFUSED_WHY)

