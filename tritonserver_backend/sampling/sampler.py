"""Next-token choice: greedy, or temperature + nucleus sampling from a per-request seeded generator.

Repetition, frequency and presence penalties reshape the logits first, from the tokens this reply has generated so
far: a small model falls into loops ("-color-color-color") far more readily than a large one, and these are the
knobs OpenAI-style clients send to stop it.

Then, in this order (vLLM's): tokens the turn may not sample are masked (a grammar's bitmask; end-of-turn and
stop_token_ids before min_tokens, end-of-turn with ignore_eos), logit_bias is added, and the choice is greedy, or
drawn after temperature, top_k, min_p and top_p. With none of these set the logits take exactly the path they took
before they existed, so greedy replies stay bit for bit what they were.
"""

from __future__ import annotations

import torch

from tritonserver_backend.sampling.params import (
    DEFAULT_MAX_TOKENS,
    MAX_TOKENS_LIMIT,
    PENALTY_LIMIT,
    REPETITION_LIMIT,
    SamplingParams,
)

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_TOKENS_LIMIT", "PENALTY_LIMIT", "REPETITION_LIMIT", "Sampler", "SamplingParams",
           "penalise"]


class Sampler:
    """Stateful per request: the generator makes a seeded reply reproducible token for token."""

    def __init__(self, params: SamplingParams, end_of_turn: int | None = None) -> None:
        """`end_of_turn`: the id min_tokens and ignore_eos mask (needed when either is set)."""
        self.params = params
        self.end_of_turn = end_of_turn
        self.generator = torch.Generator().manual_seed(params.seed)
        bias = params.logit_bias
        self._bias = ((torch.tensor([t for t, _ in bias], dtype=torch.long), torch.tensor([b for _, b in bias]))
                      if bias else None)

    def banned(self, generated: int) -> list[int]:
        """Ids masked at this step, `generated` tokens into the reply: end-of-turn (and stop_token_ids) until
        min_tokens are out; end-of-turn always with ignore_eos."""
        p = self.params
        out = []
        if generated < p.min_tokens:
            out += list(p.stop_token_ids)
        if self.end_of_turn is not None and (p.ignore_eos or generated < p.min_tokens):
            out.append(self.end_of_turn)
        return out

    def __call__(self, logits: torch.Tensor, generated: list[int] | None = None,
                 allowed: torch.Tensor | None = None) -> int:
        """logits: (vocab,) fp32, `generated`: this reply's tokens so far (what the penalties look at), `allowed`: a
        (vocab,) bool mask of the tokens the turn's grammar allows -> token id."""
        shaped = self.shaped(logits, generated, allowed)
        if self.params.temperature == 0.0:
            return int(shaped.argmax())
        return int(torch.multinomial(self.probabilities(shaped), 1, generator=self.generator))

    def shaped(self, logits: torch.Tensor, generated: list[int] | None = None,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The logits the choice is made from: penalties, logit_bias and the masks applied (a copy when any is)."""
        p = self.params
        if p.penalised and generated:
            logits = penalise(logits, generated, p)
        banned = self.banned(len(generated or ())) if p.masks_end else []
        if allowed is not None or banned or self._bias is not None:
            logits = logits.float().clone()
            if self._bias is not None:
                ids, bias = self._bias
                logits[ids[ids < logits.shape[0]]] += bias[ids < logits.shape[0]]
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            if banned:
                logits[torch.as_tensor(banned, dtype=torch.long)] = float("-inf")
        return logits

    def probabilities(self, shaped: torch.Tensor) -> torch.Tensor:
        """The distribution a sampled choice draws from (temperature > 0): temperature, top_k, min_p, top_p applied to
        `shaped` logits, normalised. Speculative sampling accepts and corrects drafts against exactly this."""
        p = self.params
        probs = torch.softmax(shaped.float() / p.temperature, dim=-1)
        if p.filtered:
            probs = filter_probs(probs, p.top_k, p.min_p)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < p.top_p  # always keeps the most likely token
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        return probs / probs.sum()


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


def filter_probs(probs: torch.Tensor, top_k: int, min_p: float) -> torch.Tensor:
    """top_k (the k most likely tokens; ties at the k-th value all stay) and min_p (tokens at least min_p x the most
    likely one's probability), renormalised."""
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()
