"""Next-token choice: greedy, or temperature + nucleus sampling from a per-request seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import BadRequest

DEFAULT_MAX_TOKENS = 64
MAX_TOKENS_LIMIT = 4096


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise BadRequest(f"max_tokens must lie in 1..{MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if not (self.temperature >= 0.0 and self.temperature < 100.0):
            raise BadRequest(f"temperature must lie in [0, 100), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest(f"top_p must lie in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise BadRequest("stop strings must be non-empty")


class Sampler:
    """Stateful per request: the generator makes a seeded reply reproducible token for token."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: (vocab,) fp32 -> token id."""
        p = self.params
        if p.temperature == 0.0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < p.top_p  # always keeps the most likely token
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))
