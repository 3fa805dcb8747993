"""Drafters for speculative decoding: what a turn's next tokens probably are, proposed before the target runs.

The scheduler feeds a turn its last token plus the drafts in one step; the decoder verifies them all at once and
keeps the longest prefix the target agrees with (`decoder_service.choose_block`). A drafter never changes a reply at
temperature 0 (the target's own choices decide), only how many tokens one step yields.

Two drafters:
* `DSparkDrafter`: the model's own drafter (the release's `mtp.*`, or the default's self-distilled one), run as the
  engines' drafter graph over each turn's ring of `draft_main` rows (`decoder_service.DraftRing`): one call drafts a
  block for every turn of a step. Its confidence head can cut a block short (`confidence`).
* `NgramDrafter`: prompt lookup (vLLM's `ngram` method): the reply's last n tokens are looked up earlier in the
  reply, and the tokens that followed them there are the draft. It needs no model, so it serves every checkpoint.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from ced.drafting.ngram import NgramDrafter

if TYPE_CHECKING:
    from tritonserver_backend.core.decoder_service import Turn
    from tritonserver_backend.engines import StepEngine


class Drafter(Protocol):
    name: str
    block: int  # most drafts per step

    def propose(self, turns: Sequence["Turn"], counts: Sequence[int]) -> list[list[int]]:
        """For each turn, up to `counts[i]` tokens that probably follow its reply so far ([]: no guess). Runs on the
        engine's thread (the scheduler's compute thread): a drafter may call the engines."""
        ...


class DSparkDrafter:
    """The engines' DSpark drafter: a block of greedy drafts per turn, from the newest `window_size` `draft_main` rows
    of its conversation (the decoder returns them under the turn's adapter, so drafts follow the adapter) and its last
    sampled token, all turns in one drafter call.

    `confidence`: a draft whose confidence score, read as a logit, gives a probability below this ends the block
    there (0: never cut). The official forward leaves the score raw; our self-distillation trains it as the logit of
    "the target agrees with this draft" (build_engines/training/drafter_stage.py)."""

    name = "dspark"

    def __init__(self, engine: "StepEngine", block: int = 4, confidence: float = 0.0) -> None:
        if engine.layout.drafter is None:
            raise ValueError("speculative dspark: these engines hold no DSpark drafter (the checkpoint ships none, "
                             "or the engines were built before it had one)")
        check_confidence(confidence)
        self.engine, self.cfg = engine, engine.cfg
        self.block = min(block, engine.layout.drafter.block_size)
        self.cut = -math.inf if confidence == 0 else math.log(confidence / (1 - confidence))

    def propose(self, turns: Sequence["Turn"], counts: Sequence[int]) -> list[list[int]]:
        asked = [b for b, (t, c) in enumerate(zip(turns, counts))
                 if c > 0 and t.draft_ring is not None and t.draft_ring.count]
        out: list[list[int]] = [[] for _ in turns]
        if not asked:
            return out
        W, dim = self.cfg.window_size, self.cfg.dim
        main_x = np.zeros((len(asked), W, dim), np.float32)
        count, last_position, last_token = (np.zeros(len(asked), np.int64) for _ in range(3))
        for i, b in enumerate(asked):
            ring = turns[b].draft_ring
            assert ring is not None
            main_x[i, :ring.count] = ring.rows
            count[i], last_position[i], last_token[i] = ring.count, ring.last_position, turns[b].generated[-1]
        result = self.engine.drafter({"main_x": main_x, "main_count": count, "last_position": last_position,
                                      "last_token": last_token})
        for i, b in enumerate(asked):
            take = min(counts[b], self.block)
            tokens, scores = result["draft_tokens"][i][:take], result["draft_confidence"][i][:take]
            below = np.flatnonzero(scores < self.cut)
            out[b] = [int(t) for t in tokens[:below[0] if below.size else take]]
        return out


DRAFTERS = ("auto", "dspark", "ngram", "off")
# most turns a lane may have going and still draft: more cost decode speed (docs/speculative.md, 16 sessions: 0.75x)
DRAFT_BATCH = 8
# drafts per step: with the fed token, the 8 positions a TensorRT decode profile verifies (trt_build.SPEC_BLOCK)
MAX_BLOCK = 7


def check_speculative(name: str, block: int, confidence: float = 0.0) -> None:
    """The `speculative*` parameters' values (ValueError naming the wrong one), before any engine is open."""
    if name not in DRAFTERS:
        raise ValueError(f"speculative: unknown drafter {name!r} (choose from {', '.join(DRAFTERS)})")
    if not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"speculative_block must lie in 1..{MAX_BLOCK} (the fed token and the drafts fill at most "
                         f"{MAX_BLOCK + 1} positions of a decode step), got {block}")
    check_confidence(confidence)


def check_confidence(confidence: float) -> None:
    if not 0.0 <= confidence < 1.0:
        raise ValueError(f"speculative_confidence must lie in [0, 1), got {confidence}")


def make_drafter(name: str, block: int = 4, engine: "StepEngine | None" = None,
                 confidence: float = 0.0) -> Drafter | None:
    """The drafter a repository's `speculative` parameter names (None: off). `auto` (the default): DSpark where the
    engines hold a drafter, else off; `dspark` on engines without one is an error."""
    check_speculative(name, block, confidence)
    if name == "off" or (name == "auto" and (engine is None or engine.layout.drafter is None)):
        return None
    if name == "ngram":
        return NgramDrafter(block)
    if engine is None:
        raise ValueError("speculative dspark needs the engines that hold the drafter")
    return DSparkDrafter(engine, block, confidence)
