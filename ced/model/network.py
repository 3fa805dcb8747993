"""The causal encoder-decoder network (PyTorch reference, the source of truth) and its two engine components.

`CEDNetwork` runs all layers in one loop. `EncoderEngine` (embedding, layers 0..19, layer-20 attention) and
`DecoderEngine` (layer-20 FFN, layers 21..39, norm, head) hold disjoint subsets of the same released parameter
names and meet only through a `HandOver`; run one after the other they reproduce `CEDNetwork` bit for bit.
Every step takes and returns explicit state (`SessionState`), so a chunked prefill, token-by-token decode and a
one-pass forward are the same code.

Engram (config `engram_layers`, encoder layers only) adds a gated n-gram lookup to the streams *before* the block of
each engram layer, as the release does. Its hash ids are computed once per chunk from the token ids and the state's
n-gram history; the tokenizer's compressed token map is a constant outside the state dict (`set_engram_token_map`),
so state dicts keep the release's names. The decoder has no Engram: every adapter shares the encoder's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from ced.model.attention import Attention, StepContext
from ced.model.config import CEDConfig
from ced.model.engram import Engram, EngramHasher, EngramTable, new_engram_history
from ced.model.hyper_connections import collapse, expand, hc_coefficients, init_hc_parameters
from ced.model.moe import MoE
from ced.model.primitives import RMSNorm
from ced.model.state import HandOver, SessionState, SourceCache, WindowRing

ATTN_PART, FFN_PART = "attn", "ffn"


class Block(nn.Module):
    """One V4.1 layer: attention and MoE sub-layers on hyper-connection streams with one-sub-layer-lagged pre-mix.

    `parts` lets an engine hold only half of a block (the encoder owns layer 20's attention, the decoder its FFN)
    while keeping the released parameter names. An engram layer's block also holds its `engram` (applied by the
    network to the streams before `attn_sublayer`, so the block's own arithmetic is unchanged).
    """

    def __init__(self, cfg: CEDConfig, layer: int, parts: Iterable[str] = (ATTN_PART, FFN_PART)) -> None:
        super().__init__()
        self.cfg, self.layer, self.parts = cfg, layer, tuple(parts)
        self.engram: Engram | None = None
        if ATTN_PART in self.parts and layer in cfg.engram_layers:
            self.engram = Engram(cfg, layer)
        if ATTN_PART in self.parts:
            self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.attn = Attention(cfg, layer)
            self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = init_hc_parameters(cfg)
        if FFN_PART in self.parts:
            self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.ffn = MoE(cfg)
            self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = init_hc_parameters(cfg)

    def attn_sublayer(self, X: torch.Tensor, pre_prev: torch.Tensor, ctx: StepContext,
                      window: WindowRing) -> tuple[torch.Tensor, torch.Tensor, WindowRing]:
        """Streams (B, S, hc, dim) and the previous sub-layer's pre -> new streams, this sub-layer's pre, ring.

        V4.1 weights the attention input with the *previous* sub-layer's pre ("single-pass mHC") and hands this
        sub-layer's own pre to the FFN input.
        """
        pre, post, C = hc_coefficients(X, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        y, window = self.attn(self.attn_norm(collapse(X, pre_prev)), ctx, window)
        return expand(y, post, C, X), pre, window

    def ffn_sublayer(self, X: torch.Tensor, attn_pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pre, post, C = hc_coefficients(X, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        y = self.ffn(self.ffn_norm(collapse(X, attn_pre)))
        return expand(y, post, C, X), pre


@dataclass
class StepOutput:
    logits: torch.Tensor  # (B, S, vocab) fp32
    state: SessionState
    hidden: list[torch.Tensor] | None = None  # per layer: streams (B, S, hc, dim) after the block, when traced
    # DSpark's input, when `targets` is given: (B, S, len(targets) * dim), per target layer (ascending) the streams
    # entering its block (after Engram) averaged over the hc copies, concatenated (ced/model/dspark.py)
    target_hidden: torch.Tensor | None = None


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) for projections, the embedding and Engram tables; norms and Engram's q/k weights stay at one
    (their constructor's value)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, EngramTable)):
            nn.init.normal_(m.weight, std=std)


def new_windows(cfg: CEDConfig, layers: Iterable[int], batch: int, device: torch.device | str,
                dtype: torch.dtype) -> dict[int, WindowRing]:
    return {l: WindowRing.empty(batch, cfg.window_size, cfg.head_dim, dtype, device) for l in layers}


def new_sources(cfg: CEDConfig, layers: Iterable[int], batch: int, device: torch.device | str,
                dtype: torch.dtype) -> dict[int, SourceCache]:
    return {l: SourceCache.empty(batch, cfg.head_dim, cfg.index_head_dim if cfg.owns_index_keys(l) else None, dtype,
                                 device) for l in layers}


def _positions(state: SessionState, length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(state.position, state.position + length, device=device)


def _check_tokens(tokens: torch.Tensor, cfg: CEDConfig, state: SessionState) -> None:
    if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tokens must be an int32/int64 tensor of shape (batch, length), "
                         f"got {tuple(tokens.shape)} {tokens.dtype}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}), "
                         f"got range [{int(tokens.min())}, {int(tokens.max())}]")
    if state.position + tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(f"sequence would reach {state.position + tokens.shape[1]} positions, "
                         f"more than max_seq_len={cfg.max_seq_len}")


def initial_streams(embed: nn.Embedding, tokens: torch.Tensor, hc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Embedding copied onto every stream (B, S, hc, dim); the first pre-mix selects stream 0."""
    h = embed(tokens)
    X = h.unsqueeze(2).expand(-1, -1, hc, -1).contiguous()
    pre = torch.zeros(*tokens.shape, hc, device=h.device)
    pre[..., 0] = 1.0
    return X, pre


class _EngramOwner:
    """What CEDNetwork and EncoderEngine share for Engram: the hasher (None without engram layers) and its token map."""

    cfg: CEDConfig
    engram_hasher: EngramHasher | None

    def set_engram_token_map(self, token_map: torch.Tensor) -> None:
        """Install the tokenizer's compressed token map (`engram.engram_token_map(cfg, tokenizer_json)`); until then
        the network hashes with `engram.placeholder_token_map`. Not part of the state dict (the release ships none:
        it is derived from the tokenizer)."""
        if self.engram_hasher is None:
            raise ValueError("this network has no Engram layers (engram_layers is empty): there is no token map to set")
        self.engram_hasher.set_token_map(token_map)

    @property
    def engram_token_map(self) -> torch.Tensor | None:
        return None if self.engram_hasher is None else self.engram_hasher.token_map

    def engram_hashes(self, tokens: torch.Tensor,
                      state: SessionState) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The chunk's hash ids (B, S, n_engram_layers, n_cols) and the history after it; (None, the state's history)
        without Engram."""
        if self.engram_hasher is None:
            return None, state.engram_history
        history = state.engram_history
        if history is None or history.shape != (tokens.shape[0], self.cfg.engram_max_ngram - 1):
            got = None if history is None else tuple(history.shape)
            raise ValueError(f"the state's engram_history is {got}, this network needs "
                             f"({tokens.shape[0]}, {self.cfg.engram_max_ngram - 1}) "
                             "(a state made for another network?)")
        return self.engram_hasher(tokens, history)

    def _new_history(self, batch: int, device: torch.device) -> torch.Tensor | None:
        return None if self.engram_hasher is None else new_engram_history(self.cfg, batch, device)


def _apply_engram(block: Block, X: torch.Tensor, hash_ids: torch.Tensor | None,
                  rows: Mapping[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Layer l's Engram on the streams entering block l (identity for other layers); `rows` (layer -> gathered rows
    (B, S, n_cols, head_dim)) replaces the block's own table, for rows read from a host-side table."""
    if block.engram is None:
        return X
    if rows is not None and block.layer in rows:
        return block.engram.mix(X, rows[block.layer])
    assert hash_ids is not None
    return block.engram(X, hash_ids[:, :, block.engram.table_index])


def _final_logits(norm: RMSNorm, head: nn.Linear, X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse the streams with the last FFN's pre-mix, normalise, project in fp32 (the head is untied)."""
    return nn.functional.linear(norm(collapse(X, pre)).float(), head.weight.float())


class CEDNetwork(_EngramOwner, nn.Module):
    """The whole network in one loop over layers; the oracle that the engine split is tested against."""

    def __init__(self, cfg: CEDConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.engram_hasher = EngramHasher(cfg) if cfg.engram_layers else None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(l): Block(cfg, l) for l in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_state(self, batch: int = 1) -> SessionState:
        dtype = self.embed.weight.dtype
        windows = new_windows(self.cfg, range(self.cfg.n_layers), batch, self.device, dtype)
        sources = new_sources(self.cfg, self.cfg.kv_source_layers, batch, self.device, dtype)
        return SessionState(0, windows, sources, self._new_history(batch, self.device))

    def forward(self, tokens: torch.Tensor, state: SessionState | None = None, trace: bool = False,
                targets: Iterable[int] = ()) -> StepOutput:
        """Process a chunk (B, S) after `state` (a fresh state when None): prefill, decode and training alike.
        `targets` (layer ids) also returns those layers' inputs for the DSpark drafter (`StepOutput.target_hidden`);
        reading them changes nothing else."""
        state = self.new_state(tokens.shape[0]) if state is None else state
        _check_tokens(tokens, self.cfg, state)
        targets = set(targets)
        if not targets <= set(range(self.cfg.n_layers)):
            raise ValueError(f"target layers {sorted(targets)} must lie in 0..{self.cfg.n_layers - 1}")
        taken: list[torch.Tensor] = []
        ctx = StepContext(_positions(state, tokens.shape[1], self.device), dict(state.sources))
        hash_ids, history = self.engram_hashes(tokens, state)
        X, pre = initial_streams(self.embed, tokens, self.cfg.hc_mult)
        windows = dict(state.windows)
        hidden = [] if trace else None
        for l in range(self.cfg.n_layers):
            block = self.layers[str(l)]
            X = _apply_engram(block, X, hash_ids)
            if l in targets:
                taken.append(X.mean(2))
            X, attn_pre, windows[l] = block.attn_sublayer(X, pre, ctx, windows[l])
            X, pre = block.ffn_sublayer(X, attn_pre)
            if hidden is not None:
                hidden.append(X)
        logits = _final_logits(self.norm, self.head, X, pre)
        return StepOutput(logits, SessionState(state.position + tokens.shape[1], windows, ctx.sources, history), hidden,
                          torch.cat(taken, -1) if taken else None)

    def split(self) -> tuple["EncoderEngine", "DecoderEngine"]:
        """Two engine components holding copies of this network's weights (and Engram token map), split at layer 20's
        attention."""
        encoder = EncoderEngine.from_state_dict(self.cfg, self.state_dict(), engram_token_map=self.engram_token_map)
        return encoder, DecoderEngine.from_state_dict(self.cfg, self.state_dict())


class _Component(nn.Module):
    """An engine component: owns a subset of the network's released parameter names."""

    cfg: CEDConfig

    @classmethod
    def from_state_dict(cls, cfg: CEDConfig, state_dict: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
        """Build the component and load exactly the tensors it owns; a missing one is a KeyError naming it."""
        engine = cls(cfg)
        own = engine.state_dict()
        missing = sorted(k for k in own if k not in state_dict)
        if missing:
            raise KeyError(f"state dict lacks tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        engine.load_state_dict({k: state_dict[k] for k in own}, strict=True)
        return engine.to(next(iter(state_dict.values())).device)


class EncoderEngine(_EngramOwner, _Component):
    """Embedding, encoder layers (with their Engram) and layer 20's attention: adapter-free, run once per token for all
    adapters."""

    def __init__(self, cfg: CEDConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E = cfg.first_decoder_layer
        self.engram_hasher = EngramHasher(cfg) if cfg.engram_layers else None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(l): Block(cfg, l) for l in range(E)})
        self.layers[str(E)] = Block(cfg, E, parts=(ATTN_PART,))

    @classmethod
    def from_state_dict(cls, cfg: CEDConfig, state_dict: dict[str, torch.Tensor],
                        engram_token_map: torch.Tensor | None = None) -> "EncoderEngine":
        """As `_Component.from_state_dict` (the Engram parameters are among the tensors it owns), plus the Engram
        token map, which no state dict carries."""
        engine = super().from_state_dict(cfg, state_dict)
        if engram_token_map is not None:
            engine.set_engram_token_map(engram_token_map)
        return engine

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_state(self, batch: int = 1) -> SessionState:
        dtype = self.embed.weight.dtype
        windows = new_windows(self.cfg, range(self.cfg.first_decoder_layer + 1), batch, self.device, dtype)
        sources = new_sources(self.cfg, self.cfg.kv_source_layers, batch, self.device, dtype)
        return SessionState(0, windows, sources, self._new_history(batch, self.device))

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embedding only: how the MoL2 router sees adapter descriptions (no prefill, no state)."""
        return self.embed(tokens)

    def forward(self, tokens: torch.Tensor, state: SessionState,
                engram_rows: Mapping[int, torch.Tensor] | None = None) -> tuple[HandOver, SessionState]:
        """`engram_rows` (engram layer -> (B, S, n_cols, head_dim) rows gathered elsewhere, e.g. from a host table
        with `engram.gather_rows` at `self.engram_hashes(...)`) replaces the tables of those layers."""
        _check_tokens(tokens, self.cfg, state)
        E = self.cfg.first_decoder_layer
        ctx = StepContext(_positions(state, tokens.shape[1], self.device), dict(state.sources))
        hash_ids, history = self.engram_hashes(tokens, state)
        X, pre = initial_streams(self.embed, tokens, self.cfg.hc_mult)
        windows = dict(state.windows)
        for l in range(E):
            block = self.layers[str(l)]
            X = _apply_engram(block, X, hash_ids, engram_rows)
            X, attn_pre, windows[l] = block.attn_sublayer(X, pre, ctx, windows[l])
            X, pre = block.ffn_sublayer(X, attn_pre)
        encoder_out = X
        X, attn_pre, windows[E] = self.layers[str(E)].attn_sublayer(X, pre, ctx, windows[E])
        assert ctx.topk is not None and ctx.candidates is not None
        handover = HandOver(
            positions=ctx.positions,
            streams=X,
            ffn_pre=attn_pre,
            topk=ctx.topk,
            candidates=ctx.candidates,
            global_kv=ctx.records["global_kv"],
            index_k=ctx.records["index_k"],
            encoder_out=encoder_out,
        )
        return handover, SessionState(state.position + tokens.shape[1], windows, ctx.sources, history)


class DecoderEngine(_Component):
    """Layer 20's FFN, layers 21..39, final norm and head: the only place adapters act."""

    def __init__(self, cfg: CEDConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E = cfg.first_decoder_layer
        self.layers = nn.ModuleDict({str(E): Block(cfg, E, parts=(FFN_PART,))})
        for l in range(E + 1, cfg.n_layers):
            self.layers[str(l)] = Block(cfg, l)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def new_state(self, batch: int = 1) -> SessionState:
        E, dtype = self.cfg.first_decoder_layer, self.head.weight.dtype
        return SessionState(0, new_windows(self.cfg, range(E + 1, self.cfg.n_layers), batch, self.device, dtype),
                            new_sources(self.cfg, [E], batch, self.device, dtype))

    def absorb(self, handover: HandOver, state: SessionState) -> SessionState:
        """Append layer 20's new global-KV rows to the decoder's mirror (adapter-independent, done once)."""
        E = self.cfg.first_decoder_layer
        first = int(handover.positions[0]) if handover.positions.numel() else state.position
        if first != state.position:
            raise ValueError(f"hand-over starts at position {first} but the decoder state is at {state.position}")
        sources = dict(state.sources)
        sources[E] = sources[E].append(handover.global_kv, handover.index_k)
        return SessionState(state.position + handover.positions.shape[0], dict(state.windows), sources)

    def run(self, handover: HandOver, state: SessionState, trace: bool = False) -> StepOutput:
        """Run hand-over rows through layer 20's FFN and the decoder layers, reading/updating only the rings.

        The global mirror must already hold the rows' entries (see `absorb`); `state.position` is not advanced,
        which is what lets the same rows be replayed under another adapter.
        """
        E = self.cfg.first_decoder_layer
        ctx = StepContext(handover.positions, dict(state.sources), topk=handover.topk, candidates=handover.candidates)
        X, pre = self.layers[str(E)].ffn_sublayer(handover.streams, handover.ffn_pre)
        windows = dict(state.windows)
        hidden = [X] if trace else None
        for l in range(E + 1, self.cfg.n_layers):
            block = self.layers[str(l)]
            X, attn_pre, windows[l] = block.attn_sublayer(X, pre, ctx, windows[l])
            X, pre = block.ffn_sublayer(X, attn_pre)
            if hidden is not None:
                hidden.append(X)
        logits = _final_logits(self.norm, self.head, X, pre)
        return StepOutput(logits, SessionState(state.position, windows, ctx.sources), hidden)

    def forward(self, handover: HandOver, state: SessionState, trace: bool = False) -> StepOutput:
        """The usual step: absorb the new rows' global KV, then run them."""
        return self.run(handover, self.absorb(handover, state), trace)
