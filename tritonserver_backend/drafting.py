"""Drafters for speculative decoding: what a turn's next tokens probably are, proposed before the target runs.

The scheduler feeds a turn its last token plus the drafts in one step; the decoder verifies them all at once and
keeps the longest prefix the target agrees with (`decoder_service.choose_block`). A drafter never changes a reply at
temperature 0 (the target's own choices decide), only how many tokens one step yields.

`NgramDrafter` is prompt-lookup drafting (vLLM's `ngram` method): the reply's last n tokens are looked up earlier in
the reply, and the tokens that followed them there are the draft. It needs no model, so it serves every checkpoint;
the release's own drafter (DSpark, `mtp.*`) is not in the engines yet (docs/speculative.md).
"""

from __future__ import annotations

from typing import Protocol


class Drafter(Protocol):
    name: str
    block: int  # most drafts per step

    def draft(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens that probably follow `tokens` (the reply so far); [] when there is no guess."""
        ...


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

    def draft(self, tokens: list[int], count: int) -> list[int]:
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


DRAFTERS = ("ngram", "off")
DRAFT_BATCH = 8  # most turns a lane may have going and still draft: more cost decode speed (docs/speculative.md, 16 sessions: 0.75x)
MAX_BLOCK = 7  # drafts per step: with the fed token, the 8 positions a TensorRT decode profile verifies (trt_build.SPEC_BLOCK)


def make_drafter(name: str, block: int = 4) -> Drafter | None:
    """The drafter a repository's `speculative` parameter names (None: off)."""
    if name == "off":
        return None
    if not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"speculative_block must lie in 1..{MAX_BLOCK} (the fed token and the drafts fill at most "
                         f"{MAX_BLOCK + 1} positions of a decode step), got {block}")
    if name == "ngram":
        return NgramDrafter(block)
    raise ValueError(f"speculative: unknown drafter {name!r} (choose from {', '.join(DRAFTERS)})")
