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
from dataclasses import dataclass

import torch

from .lora import Adapter, AdapterBank
from .network import DecoderEngine, EncoderEngine, StepOutput
from .state import HandOver, SessionState, WindowRing


@dataclass(frozen=True)
class SharedHistory:
    """Everything adapter-independent about a conversation (immutable; a step returns a new one)."""

    encoder_state: SessionState
    decoder_sources: SessionState  # decoder-side SessionState with the global-KV mirror and no rings
    recent: HandOver | None  # the last `replay_window` hand-over rows

    @property
    def position(self) -> int:
        return self.encoder_state.position

    def nbytes(self) -> int:
        return self.encoder_state.nbytes() + self.decoder_sources.nbytes() + (self.recent.nbytes() if self.recent is not None else 0)

    def equal(self, other: "SharedHistory") -> bool:
        if not (self.encoder_state.equal(other.encoder_state) and self.decoder_sources.equal(other.decoder_sources)):
            return False
        if (self.recent is None) != (other.recent is None):
            return False
        if self.recent is None:
            return True
        return all(torch.equal(getattr(self.recent, f), getattr(other.recent, f)) for f in self.recent.__dataclass_fields__)


class Conversation:
    """One session on an encoder/decoder pair and an adapter bank (attached to the decoder)."""

    def __init__(self, encoder: EncoderEngine, decoder: DecoderEngine, replay_window: int | None = None, batch: int = 1, adapter_on_encoder: bool = False) -> None:
        """`adapter_on_encoder` is for the placement experiment only: the encoder then runs under the active
        adapter too (as if an adapter touched layer 20's attention with validation bypassed), which makes the
        shared history depend on whichever adapter wrote it."""
        self.encoder, self.decoder = encoder, decoder
        self.adapter_on_encoder = adapter_on_encoder
        self.replay_window = replay_window or encoder.cfg.window_size
        if self.replay_window < 1:
            raise ValueError(f"replay_window must be positive, got {self.replay_window}")
        dec_state = decoder.new_state(batch)
        self.shared = SharedHistory(encoder.new_state(batch), SessionState(0, {}, dec_state.sources), None)
        self._empty_rings = dec_state.windows
        self.adapter: Adapter | None = None
        self.rings: dict[int, WindowRing] = dict(self._empty_rings)

    @property
    def position(self) -> int:
        return self.shared.position

    # ------------------------------------------------------------------ shared side
    @torch.no_grad()
    def extend(self, tokens: torch.Tensor) -> HandOver:
        """Encode new tokens once for all adapters; the decoder mirror and the recent rows absorb the hand-over."""
        rows = [self.adapter] * tokens.shape[0] if self.adapter_on_encoder else [None] * tokens.shape[0]
        with AdapterBank.rows(rows):
            handover, enc_state = self.encoder(tokens, self.shared.encoder_state)
        decoder_sources = self.decoder.absorb(handover, self.shared.decoder_sources)
        recent = handover if self.shared.recent is None else HandOver.concat([self.shared.recent, handover])
        keep = recent.positions.shape[0] - self.replay_window
        if keep > 0:
            recent = recent.rows(keep)
        self.shared = SharedHistory(enc_state, decoder_sources, recent)
        return handover

    # ------------------------------------------------------------------ adapter side
    def _run(self, rows: HandOver, rings: dict[int, WindowRing], adapter: Adapter | None, trace: bool) -> StepOutput:
        state = SessionState(self.position, rings, self.shared.decoder_sources.sources)
        batch = rows.streams.shape[0]
        with AdapterBank.rows([adapter] * batch):
            out = self.decoder.run(rows, state, trace)
        return out

    @torch.no_grad()
    def replay(self, adapter: Adapter | None, trace: bool = False) -> StepOutput:
        """Drop the adapter rings and rebuild them from the last W rows under `adapter` (a switch or new turn)."""
        if self.shared.recent is None:
            raise ValueError("nothing to replay: the conversation has no tokens yet")
        out = self._run(self.shared.recent, dict(self._empty_rings), adapter, trace)
        self.adapter, self.rings = adapter, dict(out.state.windows)
        return out

    @torch.no_grad()
    def new_turn(self, tokens: torch.Tensor, adapter: Adapter | None, trace: bool = False) -> StepOutput:
        """Append a user turn (encoder only), then replay the last W positions under `adapter`."""
        self.extend(tokens)
        return self.replay(adapter, trace)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, trace: bool = False) -> StepOutput:
        """Decode: encode the new token(s) and run them through the decoder on the active adapter's rings."""
        handover = self.extend(tokens)
        out = self._run(handover, self.rings, self.adapter, trace)
        self.rings = dict(out.state.windows)
        return out

    def fork(self) -> "Conversation":
        """An independent copy sharing nothing mutable (the shared history is immutable, the ring dict is copied)."""
        other = copy.copy(self)
        other.rings = dict(self.rings)
        return other

    def adapter_state_nbytes(self) -> int:
        return sum(r.nbytes() for r in self.rings.values())
