"""Per-token loss weights that put a conversation's replies ahead of its prompt.

Why: in a chat-formatted stream most tokens are prompt (the tools' rendering alone is a hundred tokens a tool, the
user's request is words drawn from the corpora), and plain next-token loss spends the model's small capacity on
predicting them. What a client is served is the reply: whether it begins a tool call or answers plainly (its first
token), which keys a JSON object has and when it closes. `ReplyWeights` weights every target inside an assistant turn
(up to and including the turn's end marker) by `reply`, and the turn's first token, where the call-or-answer
decision is taken, by `reply * first`; documents (no role markers) keep weight 1.

The weights are a function of the tokens alone (the last special token at or before each input position says whose
turn it is), so the training streams need no parallel mask and a window cut mid-conversation is weighted correctly
from its first marker on (before it, weight 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ASSISTANT_MARKER = "<|assistant|>"


@dataclass(frozen=True)
class ReplyWeights:
    opener: int  # the assistant turn's marker
    markers: tuple[int, ...]  # every special token: a turn boundary
    reply: float  # every target inside an assistant turn
    first: float  # times `reply`: the turn's first token

    @classmethod
    def from_special_ids(cls, special_ids: dict[str, int], reply: float, first: float) -> "ReplyWeights":
        if ASSISTANT_MARKER not in special_ids:
            raise ValueError(f"the tokenizer has no {ASSISTANT_MARKER} token: replies cannot be found")
        return cls(special_ids[ASSISTANT_MARKER], tuple(sorted(special_ids.values())), reply, first)

    def weights(self, inputs: torch.Tensor) -> torch.Tensor:
        """(batch, T) float weights of the targets inputs[:, t] predicts (inputs[:, t + 1] of the window)."""
        markers = torch.tensor(self.markers, device=inputs.device)
        is_marker = torch.isin(inputs, markers)
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
        last = torch.where(is_marker, positions, torch.full_like(positions, -1)).cummax(dim=1).values
        last_token = torch.gather(inputs, 1, last.clamp(min=0))
        in_reply = (last >= 0) & (last_token == self.opener)
        first = inputs == self.opener  # the target after the marker is the reply's first token
        w = torch.ones(inputs.shape, dtype=torch.float32, device=inputs.device)
        w = torch.where(in_reply, w * self.reply, w)
        return torch.where(first, w * self.first, w)


def weighted_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged with per-token weights (the weights' mean keeps the loss on the plain scale)."""
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    w = weights.flatten()
    return (ce * w).sum() / w.sum()
