"""Prompt lookup (vLLM's `ngram` method): a drafter that needs no model, so it serves every checkpoint.

The reply's last n tokens are looked up earlier in the reply, and the tokens that followed them there are the draft.
Both the serving core (`tritonserver_backend.core.drafting`) and the drafter's training stage use it.
"""

from __future__ import annotations

from typing import Any, Sequence


class NgramDrafter:
    """The reply's last `max_ngram` .. `min_ngram` tokens, looked up at their latest earlier occurrence in the reply
    (longest match first); the tokens after that occurrence are the draft."""

    name = "ngram"

    def __init__(self, block: int = 4, max_ngram: int = 3, min_ngram: int = 1, window: int = 1024) -> None:
        """`window`: how far back the lookup reaches (bounds its cost per step on long replies)."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if block < 1:
            raise ValueError(f"a draft block holds at least one token, got {block}")
        self.block, self.max_ngram, self.min_ngram, self.window = block, max_ngram, min_ngram, window

    def propose(self, turns: Sequence[Any], counts: Sequence[int]) -> list[list[int]]:
        """`turns`: anything with the reply so far as `generated` (the serving core's turns)."""
        return [self.draft(t.generated, c) for t, c in zip(turns, counts)]

    def draft(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens that probably follow `tokens` (the reply so far); [] when there is no guess."""
        count = min(count, self.block)
        if count <= 0:
            return []
        recent = tokens[-self.window:]
        for n in range(min(self.max_ngram, len(recent) - 1), self.min_ngram - 1, -1):
            tail = recent[-n:]
            for start in range(len(recent) - n - 1, -1, -1):
                if recent[start:start + n] == tail:
                    return recent[start + n:start + n + count]
        return []
