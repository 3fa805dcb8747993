"""Explicit per-session state of the CED network and the encoder -> decoder hand-over.

State goes in and out of every step as tensors (no hidden module buffers), so a session can be cloned, measured
in bytes, shared between adapters, and exported as engine inputs/outputs. Updates are functional: a step returns
new state objects and never mutates the ones it was given, which is what lets several adapters, a router and a
replay read one history without interfering.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass(frozen=True)
class WindowRing:
    """A layer's sliding-window KV: `window` slots addressed by position % window (a real ring).

    kv: (B, W, D) latents after RoPE; pos: (B, W) int64 absolute positions, -1 for an empty slot. Attention masks
    by the stored positions, so the slot order never matters and wrap-around needs no shifting.
    """

    kv: torch.Tensor
    pos: torch.Tensor

    @classmethod
    def empty(cls, batch: int, window: int, dim: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> "WindowRing":
        return cls(torch.zeros(batch, window, dim, dtype=dtype, device=device),
                   torch.full((batch, window), -1, dtype=torch.long, device=device))

    @property
    def window(self) -> int:
        return self.kv.shape[1]

    def write(self, kv: torch.Tensor, positions: torch.Tensor) -> "WindowRing":
        """Store a chunk's latents (B, S, D) at slots positions % W; only the last W of a long chunk survive."""
        W = self.window
        keep = min(W, positions.shape[0])
        kv, positions = kv[:, -keep:], positions[-keep:]
        slots = positions % W
        new_kv = self.kv.index_copy(1, slots, kv.to(self.kv.dtype))
        new_pos = self.pos.index_copy(1, slots, positions.unsqueeze(0).expand(self.pos.shape[0], -1).contiguous())
        return WindowRing(new_kv, new_pos)

    def nbytes(self) -> int:
        return _tensor_bytes(self.kv) + _tensor_bytes(self.pos)

    def clone(self) -> "WindowRing":
        return WindowRing(self.kv.clone(), self.pos.clone())


@dataclass(frozen=True)
class SourceCache:
    """The global KV written by one KV-source layer, its index keys, and its compressor's unfinished group.

    kv: (B, N, D) compressed entries after RoPE (entry j covers tokens j*ratio .. j*ratio+ratio-1);
    index_k: (B, N, Di) or None when the layer owns no index keys;
    pending_kv / pending_score: (B, c, D) raw projections of the c < ratio tokens of the incomplete group
    (always empty for ratio 1). An entry becomes visible only once its last token has been processed.
    """

    kv: torch.Tensor
    index_k: torch.Tensor | None
    pending_kv: torch.Tensor
    pending_score: torch.Tensor

    @classmethod
    def empty(cls, batch: int, dim: int, index_dim: int | None, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> "SourceCache":
        z = torch.zeros(batch, 0, dim, dtype=dtype, device=device)
        index_k = None if index_dim is None else torch.zeros(batch, 0, index_dim, dtype=dtype, device=device)
        return cls(z, index_k, z.clone(), z.clone())

    @property
    def n_entries(self) -> int:
        return self.kv.shape[1]

    def append(self, kv: torch.Tensor, index_k: torch.Tensor | None) -> "SourceCache":
        """Entries added by a ratio-1 source whose rows arrive from elsewhere (the decoder's mirror of layer 20)."""
        new_index = None if self.index_k is None else torch.cat((self.index_k, index_k), 1)  # type: ignore[arg-type]
        return SourceCache(torch.cat((self.kv, kv), 1), new_index, self.pending_kv, self.pending_score)

    def nbytes(self) -> int:
        return sum(_tensor_bytes(getattr(self, f.name)) for f in fields(self))

    def clone(self) -> "SourceCache":
        return SourceCache(*(None if getattr(self, f.name) is None else getattr(self, f.name).clone()
                             for f in fields(self)))


@dataclass(frozen=True)
class SessionState:
    """Everything a stack of layers needs to continue a sequence: position, window rings, global-KV sources, and the
    Engram n-gram history.

    The whole network keeps rings for every layer and every source. The encoder side keeps rings for layers
    0..20 (layer 20's attention runs there) and all sources; the decoder side keeps rings for 21..39 and a
    mirror of layer 20's source, fed by the hand-over.

    engram_history: (B, max_ngram - 1) int64 compressed ids of the last positions, oldest first, -1 where no token
    precedes (a fresh session); None when the config has no Engram and on the decoder side (Engram is encoder-only,
    so the history is shared by every adapter). Bounded: the hash of a position looks back max_ngram - 1 tokens only.
    """

    position: int
    windows: dict[int, WindowRing] = field(default_factory=dict)
    sources: dict[int, SourceCache] = field(default_factory=dict)
    engram_history: torch.Tensor | None = None

    def nbytes(self) -> int:
        rings = sum(w.nbytes() for w in self.windows.values())
        return rings + sum(s.nbytes() for s in self.sources.values()) + _tensor_bytes(self.engram_history)

    def clone(self) -> "SessionState":
        history = None if self.engram_history is None else self.engram_history.clone()
        windows = {k: v.clone() for k, v in self.windows.items()}
        return SessionState(self.position, windows, {k: v.clone() for k, v in self.sources.items()}, history)

    def equal(self, other: "SessionState") -> bool:
        """Bitwise equality of every tensor (what "state left untouched" means in tests)."""
        if (self.position != other.position or self.windows.keys() != other.windows.keys()
                or self.sources.keys() != other.sources.keys()):
            return False
        a, b = self.engram_history, other.engram_history
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            return False
        for k, w in self.windows.items():
            if not (torch.equal(w.kv, other.windows[k].kv) and torch.equal(w.pos, other.windows[k].pos)):
                return False
        for k, s in self.sources.items():
            o = other.sources[k]
            for f in fields(s):
                a, b = getattr(s, f.name), getattr(o, f.name)
                if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                    return False
        return True


@dataclass(frozen=True)
class HandOver:
    """What the encoder engine passes to the decoder engine for a chunk of S positions (all adapter-independent).

    positions:   (S,) int64        absolute positions of the rows
    streams:     (B, S, hc, dim)   hyper-connection residual streams after layer 20's attention sub-layer
    ffn_pre:     (B, S, hc)        layer 20's attention-side `pre` mix, which weights the streams into its FFN
    topk:        (B, S, K) int64   layer 20's top-k global-KV entries per row (-1 = empty slot), reused by 21..23
    candidates:  (B, S, C) int64   layer 20's candidate blocks per row (-1 = empty), the pool re-index layers use
    global_kv:   (B, S, D)         layer 20's new global-KV entries (ratio 1: one per row), post-RoPE
    index_k:     (B, S, Di)        layer 20's new index keys, post-RoPE
    encoder_out: (B, S, hc, dim)   "H19": the streams after the last encoder layer, read by the MoL2 router
    """

    positions: torch.Tensor
    streams: torch.Tensor
    ffn_pre: torch.Tensor
    topk: torch.Tensor
    candidates: torch.Tensor
    global_kv: torch.Tensor
    index_k: torch.Tensor
    encoder_out: torch.Tensor

    def rows(self, start: int, stop: int | None = None) -> "HandOver":
        """The hand-over restricted to rows [start, stop) (the decoder keeps the last W rows for replay)."""
        s = slice(start, stop)
        return HandOver(self.positions[s], self.streams[:, s], self.ffn_pre[:, s], self.topk[:, s],
                        self.candidates[:, s], self.global_kv[:, s], self.index_k[:, s], self.encoder_out[:, s])

    @staticmethod
    def concat(parts: list["HandOver"]) -> "HandOver":
        return HandOver(*(torch.cat([getattr(p, f.name) for p in parts], 0 if f.name == "positions" else 1)
                          for f in fields(HandOver)))

    def nbytes(self) -> int:
        return sum(_tensor_bytes(getattr(self, f.name)) for f in fields(self))
