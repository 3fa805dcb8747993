"""Next-token choice: greedy, or temperature + nucleus sampling from a per-request seeded generator.

Repetition, frequency and presence penalties reshape the logits first, from the tokens this reply has generated so
far: a small model falls into loops ("-color-color-color") far more readily than a large one, and these are the
knobs OpenAI-style clients send to stop it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import BadRequest

DEFAULT_MAX_TOKENS = 64
MAX_TOKENS_LIMIT = 4096
PENALTY_LIMIT = 2.0  # the OpenAI API's range for frequency and presence penalties
REPETITION_LIMIT = 10.0


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

    @property
    def penalised(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


class Sampler:
    """Stateful per request: the generator makes a seeded reply reproducible token for token."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor, generated: list[int] | None = None) -> int:
        """logits: (vocab,) fp32, `generated`: this reply's tokens so far (what the penalties look at) -> token id."""
        p = self.params
        if p.penalised and generated:
            logits = penalise(logits, generated, p)
        if p.temperature == 0.0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < p.top_p  # always keeps the most likely token
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))


def penalise(logits: torch.Tensor, generated: list[int], p: SamplingParams) -> torch.Tensor:
    """The penalties applied to a copy of `logits` (the engine's output stays untouched)."""
    out = logits.float().clone()
    ids, counts = torch.unique(torch.as_tensor(generated, dtype=torch.long), return_counts=True)
    seen = out[ids]
    if p.repetition_penalty != 1.0:
        seen = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
    seen = seen - p.frequency_penalty * counts.float() - p.presence_penalty
    out[ids] = seen
    return out
