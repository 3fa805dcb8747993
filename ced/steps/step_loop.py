"""The engine step loop outside the serving path: encoder steps, the hand-over, the decoder's bounded replay and its
per-token steps, for a batch of sessions whose rows live here.

Tools and tests that run the graphs (or their modules) directly (perplexity, calibration, benchmarks, the device
check) all step a session the same way the services do: `encoder_inputs` -> encoder -> `absorb_encoder`, the new
hand-over rows into each `DecoderRow`, `decoder_inputs` -> decoder -> `absorb_decoder`. `StepLoop` is that loop once,
so that a change to the row contract (a new state field, a new input) is made in one place outside the services.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ced.steps.layout import StepLayout
from ced.steps.rows import (
    HANDOVER_FIELDS,
    HANDOVER_KEYS,
    DecoderRow,
    EncoderRow,
    Runner,
    absorb_decoder,
    absorb_encoder,
    decoder_inputs,
    encoder_inputs,
)

if TYPE_CHECKING:
    from ced.steps.engram_feed import EngramFeed

Arrays = dict[str, np.ndarray]
# (kind, feed, outputs) of every step, before the rows absorb it; kind "encoder", "replay" or "decode". The decoder's
# feed excludes the LoRA bank (as `decoder_inputs` returns it: the runtime binds the bank).
Observer = Callable[[str, Arrays, Arrays], None]


class StepLoop:
    """B sessions (one per adapter slot in `slots`) stepped through `encoder` and `decoder` runners.

    `bank`: the stacked adapter bank added to every decoder feed ({} when the runner binds its own). `observe` sees each
    step's feed and outputs before the rows absorb them (calibration records them)."""

    def __init__(self, layout: StepLayout, encoder: Runner, decoder: Runner, slots: Sequence[int],
                 bank: Arrays | None = None, engram: "EngramFeed | None" = None,
                 observe: Observer | None = None) -> None:
        self.layout, self.encoder, self.decoder = layout, encoder, decoder
        self.slots, self.bank, self.engram, self.observe = list(slots), dict(bank or {}), engram, observe
        self.erows = [EncoderRow.empty(layout) for _ in self.slots]
        self.drows = [DecoderRow.empty(layout) for _ in self.slots]

    def encode(self, tokens: np.ndarray) -> Arrays:
        """One encoder step of `tokens` (B, S): every session advances by S positions. Returns the step's outputs."""
        tokens = np.asarray(tokens, np.int64)
        feed = encoder_inputs(self.layout, self.erows, tokens, engram=self.engram)
        out = self.encoder(feed)
        if self.observe is not None:
            self.observe("encoder", feed, out)
        absorb_encoder(self.layout, self.erows, out, tokens.shape[1], tokens)
        return out

    @staticmethod
    def handovers(out: Arrays, batch: int) -> list[Arrays]:
        """An encoder step's outputs as each session's hand-over rows (S, ...)."""
        return [{k: out[k][b] for k in HANDOVER_KEYS} for b in range(batch)]

    def hand_over(self, rows: Sequence[Arrays]) -> None:
        """New hand-over rows into each session's decoder row (its mirror of the global KV and index keys)."""
        for drow, row in zip(self.drows, rows):
            drow.absorb(self.layout, row)

    def replay(self) -> Arrays:
        """The bounded replay of each session's last window under its slot (what a turn starts with)."""
        feed = decoder_inputs(self.layout, self.drows, None, self.slots)
        out = self.decoder({**feed, **self.bank})
        if self.observe is not None:
            self.observe("replay", feed, out)
        absorb_decoder(self.drows, out, feed, True, self.slots)
        return out

    def decode(self, rows: Sequence[Arrays]) -> Arrays:
        """One decoder step on each session's new positions: `rows` are their hand-over rows (S, ...); S is 1 for a
        generated token, a chunk's length for a full hand-off."""
        self.hand_over(rows)
        feed = decoder_inputs(self.layout, self.drows, [{k: r[k] for k in HANDOVER_FIELDS} for r in rows], self.slots)
        out = self.decoder({**feed, **self.bank})
        if self.observe is not None:
            self.observe("decode", feed, out)
        absorb_decoder(self.drows, out, feed, False, self.slots)
        return out

    def prefill(self, tokens: np.ndarray, chunk: int | None = None) -> list[Arrays]:
        """Encoder prefill of `tokens` (B, L) in `chunk`-position steps (None: one step), each chunk's rows handed
        over at once. Returns each session's whole hand-over (L, ...)."""
        tokens = np.asarray(tokens, np.int64)
        step = chunk or max(tokens.shape[1], 1)
        parts: list[list[Arrays]] = []
        for i in range(0, tokens.shape[1], step):
            rows = self.handovers(self.encode(tokens[:, i:i + step]), tokens.shape[0])
            self.hand_over(rows)
            parts.append(rows)
        return [{k: np.concatenate([p[b][k] for p in parts]) for k in HANDOVER_KEYS} for b in range(tokens.shape[0])]

    def next_token(self, tokens: np.ndarray) -> Arrays:
        """One generated token per session (B,): an encoder step of it, then a decoder step on its hand-over row."""
        out = self.encode(np.asarray(tokens, np.int64).reshape(-1, 1))
        return self.decode(self.handovers(out, len(self.slots)))


def prefill_and_replay(layout: StepLayout, encoder: Runner, decoder: Runner, bank: Arrays, tokens: np.ndarray,
                       chunk: int, slot: int = 0, engram: "EngramFeed | None" = None) -> tuple[EncoderRow, DecoderRow]:
    """A session's rows after the encoder prefill of `tokens` (1-D) in `chunk`-token steps and a bounded replay under
    `slot`: the state a turn leaves, for tools and tests that run the graphs (or their modules) directly."""
    loop = StepLoop(layout, encoder, decoder, [slot], bank, engram)
    loop.prefill(np.asarray(tokens)[None], chunk)
    loop.replay()
    return loop.erows[0], loop.drows[0]
