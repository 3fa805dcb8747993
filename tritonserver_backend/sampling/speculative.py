"""Accepting a speculative block: which drafted tokens a turn keeps, and the token that follows them.

A verified block is the target's logits after the turn's last sampled token and after each draft (the decoder's
`verify_logits`, bit for bit the logits one-token steps would give: docs/speculative.md). From them:

- Greedy (temperature 0): a draft is kept while it equals the token the turn's own sampler chooses at its position:
  the same call, on the same logits, with the same history for the penalties. So the reply is token for token the
  reply without drafting. The first draft that differs is replaced by the sampler's choice; when every draft is kept,
  the logits after the last one give one more token.
- Temperature > 0, a drafter that proposes one token per position (both of the server's drafters: DSpark drafts
  greedily, prompt lookup copies; `draft_probs` None): the same rule. The turn's sampler draws at each position as
  plain decoding would, and the draft is kept while the draw equals it. This IS speculative sampling (Leviathan et
  al. 2023, Chen et al. 2023) for a one-hot drafter distribution q: the draft d is kept with probability p(d) =
  min(1, p(d) / q(d)), and a rejected position emits a draw from p conditioned on "not d", which is max(0, p - q)
  normalised. And since the seeded generator is consumed exactly as without drafting (one draw per emitted token,
  on bitwise the same logits and history), a sampled reply with drafting is the plain reply, token for token.
- A drafter with a real distribution (`draft_probs`): draft d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)),
  where p_i is what the sampler draws from (penalties, bias, temperature, top-k, min-p, top-p applied:
  `Sampler.probabilities`); a rejected draft is replaced by a draw from max(0, p_i - q_i), normalised. Every token is
  distributed as the sampler's own draw, though not the same draw (the generator is consumed differently).

Grammar-constrained turns are not drafted (their mask follows every token), and the caller trims what this returns at
the end of the turn (end-of-turn, a stop token, max_tokens), as it does for one token.
"""

from __future__ import annotations

import torch

from tritonserver_backend.sampling.sampler import Sampler


def accept_block(sampler: Sampler, verify_logits: torch.Tensor, drafts: list[int], generated: list[int],
                 draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens a turn emits from a verified block: the kept drafts, then the target's token after them.

    verify_logits (len(drafts) + 1, vocab): logits after the last sampled token and after each draft; `generated`:
    the reply's tokens before the block; draft_probs (len(drafts), vocab): the drafter's distributions (None: the
    drafts were its argmax, one-hot). Returns 1 .. len(drafts) + 1 tokens."""
    if verify_logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"a block of {len(drafts)} drafts is verified by {len(drafts) + 1} rows of logits, "
                         f"got {verify_logits.shape[0]}")
    if draft_probs is not None and draft_probs.shape[0] != len(drafts):
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows for {len(drafts)} drafts")
    out: list[int] = []
    own_draws = sampler.params.temperature == 0.0 or draft_probs is None
    for i, draft in enumerate(drafts):
        history = generated + out
        if own_draws:
            chosen = sampler(verify_logits[i], history)
            out.append(chosen)
            if chosen != draft:
                return out
            continue
        p = sampler.probabilities(sampler.shaped(verify_logits[i], history))
        assert draft_probs is not None
        q = draft_probs[i].float()
        ratio = p[draft] / q[draft] if q[draft] > 0 else torch.tensor(0.0)
        if torch.rand((), generator=sampler.generator) < ratio:
            out.append(draft)
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = residual.sum()
        # p == q on the support (nothing left to correct towards) only when the draft was certain to be kept
        choice = p if total <= 0 else residual / total
        out.append(int(torch.multinomial(choice, 1, generator=sampler.generator)))
        return out
    out.append(sampler(verify_logits[len(drafts)], generated + out))
    return out

