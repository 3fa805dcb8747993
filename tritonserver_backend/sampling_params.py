"""A request's sampling parameters, validated; kept free of torch so that preprocess can check them (bad values fail
before the turn is encoded) without importing PyTorch. `sampling.py` does the sampling."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BadRequest

DEFAULT_MAX_TOKENS = 64
MAX_TOKENS_LIMIT = 4096
PENALTY_LIMIT = 2.0  # the OpenAI API's range for frequency and presence penalties
REPETITION_LIMIT = 10.0
TOP_LOGPROBS_LIMIT = 20  # the OpenAI API's limit for top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0  # OpenAI semantics: logit -= penalty * count of the token in the reply so far
    presence_penalty: float = 0.0  # logit -= penalty once the token appeared in the reply
    repetition_penalty: float = 1.0  # CTRL / HF semantics: a seen token's logit is divided (>0) or multiplied (<0) by it
    logprobs: bool = False  # return each sampled token's log-probability (log-softmax of the raw logits)
    top_logprobs: int = 0  # and the k most likely tokens at each position with theirs

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise BadRequest(f"max_tokens must lie in 1..{MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if not (self.temperature >= 0.0 and self.temperature < 100.0):
            raise BadRequest(f"temperature must lie in [0, 100), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest(f"top_p must lie in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise BadRequest("stop strings must be non-empty")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise BadRequest(f"{name} must lie in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= REPETITION_LIMIT:
            raise BadRequest(f"repetition_penalty must lie in (0, {REPETITION_LIMIT:g}], got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= TOP_LOGPROBS_LIMIT:
            raise BadRequest(f"top_logprobs must lie in 0..{TOP_LOGPROBS_LIMIT}, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true")

    @property
    def penalised(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
