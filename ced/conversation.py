"""A conversation whose history is shared by every adapter, with bounded replay on each turn and switch.

State is split as in DESIGN section 3:
- shared, written once for all adapters: the encoder state (rings of layers 0..20, every global-KV source) and
  the decoder's mirror of layer 20's global KV, plus the last W hand-over rows;
- owned by the active adapter: the window rings of layers 21..39 only.
A new turn or an adapter switch drops those rings and replays the last W rows through layer 20's FFN and layers
21..39 under the target adapter: O(W) work whatever the context length.
"""

from __future__ import annotations

import copy

import torch

from ced.lora import Adapter, AdapterBank
from ced.model.network import DecoderEngine, EncoderEngine, StepOutput
from ced.model.state import HandOver, SessionState, WindowRing


class DecoderSession:
    """The decoder side of one session: the global-KV mirror and last W hand-over rows (shared by every
    adapter) plus the active adapter's rings of layers 21..39 (the only adapter-owned state).

    It only ever sees hand-over rows, so it runs the same in-process and in a separate Triton model.
    """

    def __init__(self, decoder: DecoderEngine, replay_window: int, batch: int = 1) -> None:
        if replay_window < 1:
            raise ValueError(f"replay_window must be positive, got {replay_window}")
        self.decoder, self.replay_window = decoder, replay_window
        state = decoder.new_state(batch)
        self.sources = SessionState(0, {}, state.sources)  # position + layer 20's mirror, no rings
        self.recent: HandOver | None = None
        self._empty_rings = state.windows
        self.adapter: Adapter | None = None
        self.rings: dict[int, WindowRing] = dict(self._empty_rings)

    @property
    def position(self) -> int:
        return self.sources.position

    def absorb(self, handover: HandOver) -> None:
        """Append new rows' global KV to the mirror and keep the last W rows for replay (adapter-independent)."""
        self.sources = self.decoder.absorb(handover, self.sources)
        recent = handover if self.recent is None else HandOver.concat([self.recent, handover])
        drop = recent.positions.shape[0] - self.replay_window
        self.recent = recent.rows(drop) if drop > 0 else recent

    def _run(self, rows: HandOver, rings: dict[int, WindowRing], adapter: Adapter | None, trace: bool) -> StepOutput:
        state = SessionState(self.position, rings, self.sources.sources)
        with AdapterBank.rows([adapter] * rows.streams.shape[0]):
            return self.decoder.run(rows, state, trace)

    @torch.no_grad()
    def replay(self, adapter: Adapter | None, trace: bool = False) -> StepOutput:
        """Drop the adapter rings and rebuild them from the last W rows under `adapter` (a switch or new turn)."""
        if self.recent is None:
            raise ValueError("nothing to replay: the session has no tokens yet")
        out = self._run(self.recent, dict(self._empty_rings), adapter, trace)
        self.adapter, self.rings = adapter, dict(out.state.windows)
        return out

    @torch.no_grad()
    def step(self, handover: HandOver, trace: bool = False) -> StepOutput:
        """Decode: absorb the new rows, then run them on the active adapter's rings."""
        self.absorb(handover)
        out = self._run(handover, self.rings, self.adapter, trace)
        self.rings = dict(out.state.windows)
        return out

    def fork(self) -> "DecoderSession":
        """An independent copy (the mirror and rows are immutable; the ring dict is copied)."""
        other = copy.copy(self)
        other.rings = dict(self.rings)
        return other

    def shared_equal(self, other: "DecoderSession") -> bool:
        """Bitwise equality of the adapter-independent part."""
        if not self.sources.equal(other.sources) or (self.recent is None) != (other.recent is None):
            return False
        return self.recent is None or all(
            torch.equal(getattr(self.recent, f), getattr(other.recent, f)) for f in self.recent.__dataclass_fields__
        )

    def nbytes(self) -> int:
        return (self.sources.nbytes() + (self.recent.nbytes() if self.recent is not None else 0)
                + sum(r.nbytes() for r in self.rings.values()))


class Conversation:
    """One in-process session: the encoder state plus a `DecoderSession` (what the Triton models split)."""

    def __init__(self, encoder: EncoderEngine, decoder: DecoderEngine, replay_window: int | None = None, batch: int = 1,
                 adapter_on_encoder: bool = False) -> None:
        """`adapter_on_encoder` is for the placement experiment only: the encoder then runs under the active
        adapter too (as if an adapter touched layer 20's attention with validation bypassed), which makes the
        shared history depend on whichever adapter wrote it."""
        self.encoder = encoder
        self.adapter_on_encoder = adapter_on_encoder
        self.encoder_state = encoder.new_state(batch)
        self.decoder = DecoderSession(decoder, replay_window or encoder.cfg.window_size, batch)

    @property
    def position(self) -> int:
        return self.encoder_state.position

    @property
    def adapter(self) -> Adapter | None:
        return self.decoder.adapter

    @adapter.setter
    def adapter(self, value: Adapter | None) -> None:
        self.decoder.adapter = value

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor) -> HandOver:
        """Encode new tokens once for all adapters; the decoder side absorbs the hand-over."""
        rows = [self.adapter if self.adapter_on_encoder else None] * tokens.shape[0]
        with AdapterBank.rows(rows):
            handover, self.encoder_state = self.encoder(tokens, self.encoder_state)
        self.decoder.absorb(handover)
        return handover

    def replay(self, adapter: Adapter | None, trace: bool = False) -> StepOutput:
        return self.decoder.replay(adapter, trace)

    def new_turn(self, tokens: torch.Tensor, adapter: Adapter | None, trace: bool = False) -> StepOutput:
        """Append a user turn (encoder only), then replay the last W positions under `adapter`."""
        self.extend(tokens)
        return self.decoder.replay(adapter, trace)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, trace: bool = False) -> StepOutput:
        """Decode: encode the new token(s) and run them through the decoder on the active adapter's rings."""
        rows = [self.adapter if self.adapter_on_encoder else None] * tokens.shape[0]
        with AdapterBank.rows(rows):
            handover, self.encoder_state = self.encoder(tokens, self.encoder_state)
        return self.decoder.step(handover, trace)

    def fork(self) -> "Conversation":
        other = copy.copy(self)
        other.decoder = self.decoder.fork()
        return other

    def shared_nbytes(self) -> int:
        return (self.encoder_state.nbytes() + self.decoder.sources.nbytes()
                + (self.decoder.recent.nbytes() if self.decoder.recent is not None else 0))
