"""A request's sampling parameters, validated; kept free of torch so that preprocess can check them (bad values fail
before the turn is encoded) without importing PyTorch. `sampling.py` does the sampling."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from tritonserver_backend.errors import BadRequest

DEFAULT_MAX_TOKENS = 64
MAX_TOKENS_LIMIT = 4096
PENALTY_LIMIT = 2.0  # the OpenAI API's range for frequency and presence penalties
REPETITION_LIMIT = 10.0
TOP_LOGPROBS_LIMIT = 20  # the OpenAI API's limit for top_logprobs
MAX_FORCED = 8192  # forced_ids per turn (a context's worth)
LOGIT_BIAS_LIMIT = 100.0  # the OpenAI API's range for a logit bias
LOGIT_BIAS_ENTRIES = 1024  # tokens one logit_bias may name
STOP_TOKEN_IDS_LIMIT = 64


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0  # OpenAI semantics: logit -= penalty * count of the token in the reply so far
    presence_penalty: float = 0.0  # logit -= penalty once the token appeared in the reply
    # CTRL / HF semantics: a seen token's logit is divided (>0) or multiplied (<0) by it
    repetition_penalty: float = 1.0
    logprobs: bool = False  # return each sampled token's log-probability (log-softmax of the raw logits)
    top_logprobs: int = 0  # and the k most likely tokens at each position with theirs
    raw: bool = False  # a completions turn (contract.RAW): plain text, no end-of-turn after the reply
    # teacher forcing (contract.FORCED_IDS): emitted first, in this order, never sampled
    forced_ids: tuple[int, ...] = ()
    top_k: int = 0  # sample among the k most likely tokens; 0 (or -1, vLLM's "off") = all
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the most likely one's; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits, OpenAI semantics
    stop_token_ids: tuple[int, ...] = ()  # sampling one ends the turn (finish "stop"; the token is not in the reply)
    min_tokens: int = 0  # end-of-turn and stop_token_ids are masked until the reply has this many tokens
    ignore_eos: bool = False  # end-of-turn is never sampled: the reply runs to max_tokens (or a stop)
    grammar: str = ""  # canonical JSON of a grammar spec (grammar_spec.canonical); "" = unconstrained
    speculative: bool = True  # the turn's tokens may be drafted where the server decodes speculatively (off: opt out)

    def __post_init__(self) -> None:
        if not 0 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise BadRequest(f"max_tokens must lie in 0..{MAX_TOKENS_LIMIT} (0: encode the turn only), got "
                             f"{self.max_tokens}")
        if len(self.forced_ids) > MAX_FORCED or any(t < 0 for t in self.forced_ids):
            raise BadRequest(f"forced_ids takes up to {MAX_FORCED} non-negative token ids, got {len(self.forced_ids)}")
        if not (self.temperature >= 0.0 and self.temperature < 100.0):
            raise BadRequest(f"temperature must lie in [0, 100), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest(f"top_p must lie in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise BadRequest("stop strings must be non-empty")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise BadRequest(f"{name} must lie in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got "
                                 f"{getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= REPETITION_LIMIT:
            raise BadRequest(f"repetition_penalty must lie in (0, {REPETITION_LIMIT:g}], got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= TOP_LOGPROBS_LIMIT:
            raise BadRequest(f"top_logprobs must lie in 0..{TOP_LOGPROBS_LIMIT}, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true")
        if self.top_k < -1:
            raise BadRequest(f"top_k must be -1 or 0 (off) or a positive number of tokens, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequest(f"min_p must lie in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > LOGIT_BIAS_ENTRIES:
            raise BadRequest(f"logit_bias names {len(self.logit_bias)} tokens, more than {LOGIT_BIAS_ENTRIES}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise BadRequest(f"logit_bias: token id {token} is negative")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise BadRequest(f"logit_bias of token {token} must lie in [-{LOGIT_BIAS_LIMIT:g}, "
                                 f"{LOGIT_BIAS_LIMIT:g}], got {bias}")
        if len(self.stop_token_ids) > STOP_TOKEN_IDS_LIMIT or any(t < 0 for t in self.stop_token_ids):
            raise BadRequest(f"stop_token_ids takes up to {STOP_TOKEN_IDS_LIMIT} non-negative token ids")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise BadRequest(f"min_tokens must lie in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.grammar and (self.ignore_eos or self.min_tokens):
            raise BadRequest("a grammar decides where the reply ends: it cannot be combined with ignore_eos or "
                             "min_tokens")
        if self.grammar and self.forced_ids:
            raise BadRequest("a grammar cannot be combined with forced_ids (the forced tokens would bypass it)")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids of logit_bias and stop_token_ids against the vocabulary (known to preprocess and the decoder)."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size] + [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")

    @property
    def masks_end(self) -> bool:
        """Whether end-of-turn (and stop_token_ids) may be masked out at some step: min_tokens or ignore_eos."""
        return self.ignore_eos or self.min_tokens > 0

    @property
    def filtered(self) -> bool:
        """Whether top_k or min_p narrows the sampled distribution."""
        return self.top_k > 0 or self.min_p > 0.0

    @property
    def penalised(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


def parse_logit_bias(text: str) -> tuple[tuple[int, float], ...]:
    """The tensor API's logit_bias: a JSON object of token id (a string, as OpenAI sends it, or a number) -> bias."""
    if not text:
        return ()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"logit_bias is not valid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise BadRequest('logit_bias must be a JSON object of token id -> bias, e.g. {"42": -100}')
    out = []
    for key, value in data.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias: {key!r} is not a token id") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest(f"logit_bias of token {key} must be a number, got {value!r}")
        out.append((token, float(value)))
    return tuple(sorted(out))
