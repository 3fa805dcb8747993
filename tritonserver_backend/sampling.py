"""Next-token choice: greedy, or temperature + nucleus sampling from a per-request seeded generator.

Repetition, frequency and presence penalties reshape the logits first, from the tokens this reply has generated so
far: a small model falls into loops ("-color-color-color") far more readily than a large one, and these are the
knobs OpenAI-style clients send to stop it.
"""

from __future__ import annotations

import torch

from .sampling_params import DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT, PENALTY_LIMIT, REPETITION_LIMIT, SamplingParams

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_TOKENS_LIMIT", "PENALTY_LIMIT", "REPETITION_LIMIT", "Sampler", "SamplingParams", "penalise"]


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
