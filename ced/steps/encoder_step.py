"""One encoder step for a batch of rows: embedding, layers 0..E-1 and layer E's attention, state in and out.

Each row carries its own position (`start`), window rings and global-KV stores (padded to a common length N; what a
row has not written yet is never visible to it, by position). The step returns this step's new rows only (ring
latents, new global entries and index keys, the compressor's unpaired token) and the hand-over; the runtime writes
them into the row's state. In a store, this step's new entries are not there yet: the attention reads them from the
local table (ring, chunk latents, new entries) and the index scores of old and new keys are merged into absolute
entry order, so every top-k index leaving the encoder is an absolute entry id the decoder's mirror understands.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ced.model.attention import window_rows
from ced.model.engram import GATE_FLOOR
from ced.model.network import EncoderEngine
from ced.steps.common import (
    FakeQuant,
    RopeKinds,
    StepModule,
    SublayerWiring,
    candidate_blocks,
    index_scores,
    output_projection,
    plain_linear,
    query_and_latent,
    visible,
)
from ced.steps.graph_ops import chunk_positions, plus_eps, rms_norm, select_top, window_ring_positions
from ced.steps.stored_weights import experts_for, stored_chunks
from plugins.sparse_global_attention import sparse_global_attention
from plugins.swa_replay_attention import swa_replay_attention


@dataclass
class _Source:
    """One global-KV source during a step: the stored entries, this step's new ones, and how many were stored."""

    kv: torch.Tensor  # (B, N, D) stored entries
    index_k: torch.Tensor  # (B, N, Di)
    used: torch.Tensor  # (B,) entries stored before this step
    new_kv: torch.Tensor | None = None  # (B, M, D)
    new_index_k: torch.Tensor | None = None  # (B, M, Di)
    pending: torch.Tensor | None = None  # (B, 2, D) the stored unpaired token's raw kv and gate score
    pending_rows: torch.Tensor | None = None  # (B, S, 2, D) every token of this step's raw kv and gate score


class EncoderStep(StepModule):
    def __init__(self, engine: EncoderEngine) -> None:
        super().__init__(engine)
        cfg = self.cfg
        self.wiring = {l: SublayerWiring(cfg, engine.layers[str(l)], self.patterns) for l in range(self.E + 1)}
        self.experts = {l: experts_for(engine.layers[str(l)].ffn) for l in range(self.E)}
        self.expert_chunks = stored_chunks(self.experts)
        self.attentions = {l: engine.layers[str(l)].attn for l in range(self.E + 1)}

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, rings: torch.Tensor,
                *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`state`: the global-KV stores (`StepLayout.encoder_inputs` order), then one `engram_rows_<l>` per Engram
        layer."""
        cfg, E, W = self.cfg, self.E, self.cfg.window_size
        B, S = tokens.shape
        n_engram = len(self.layout.engram_layers)
        stores, engram_rows = (state[: len(state) - n_engram],
                               dict(zip(self.layout.engram_layers, state[len(state) - n_engram:])))
        positions = chunk_positions(start, S, tokens)
        ring_pos = window_ring_positions(start, torch.zeros_like(start), W)
        win = window_rows(ring_pos, positions, W)  # (B, S, W) rows of [ring ; chunk ; ...]
        sources = self._sources(start, stores)
        ropes = RopeKinds(cfg, self.attentions)
        ctx: dict[str, torch.Tensor] = {}
        ring_rows: list[torch.Tensor] = []

        X = self.engine.embed(tokens).float().unsqueeze(2).expand(B, S, cfg.hc_mult, cfg.dim)
        pre = (torch.arange(cfg.hc_mult, device=X.device) == 0).float().expand(B, S, cfg.hc_mult)  # stream 0 first
        h19 = X
        for l in range(E + 1):
            if l == E:
                h19 = X
            if l in engram_rows:  # before the block, on the streams entering it, as the reference network
                X = self._engram(l, X, engram_rows[l])
            run = lambda x, l=l: self.comm.all_reduce(  # noqa: E731
                self._attention(l, x, rings[:, l], positions, win, sources, ropes, ctx, ring_rows), "attn")
            X, attn_pre = self.wiring[l].attention(X, pre, run)
            if l < E:
                X, pre = self.wiring[l].ffn(X, attn_pre, lambda x, l=l: self._moe(l, x))
        last = sources[E]
        outputs = [h19.mean(2), X, attn_pre, ctx["topk"], ctx["candidates"], last.new_kv, last.new_index_k,
                   torch.stack(ring_rows, 1)]
        for s in self.layout.sources:
            if self.layout.ratio[s] == 2:
                outputs += [sources[s].new_kv, sources[s].new_index_k, sources[s].pending_rows]
        return tuple(outputs)

    # ------------------------------------------------------------------ state
    def _sources(self, start: torch.Tensor, stores: tuple[torch.Tensor, ...]) -> dict[int, _Source]:
        out, it = {}, iter(stores)
        for s in self.layout.sources:
            kv, index_k = next(it), next(it)
            src = _Source(kv, index_k, start // self.layout.ratio[s])
            if self.layout.ratio[s] == 2:
                src.pending = next(it)
            out[s] = src
        return out

    # ------------------------------------------------------------------ layers
    def _engram(self, layer: int, X: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`Engram.mix` in exportable ops on rows the host gathered: the value projection (its input fp8-quantized
        under the runtime fake-quant, as every fp8-weight GEMM's), the per-copy normalised key/stream gate."""
        engram = self.engine.layers[str(layer)].engram
        hc, dim, eps = self.cfg.hc_mult, self.cfg.dim, self.cfg.norm_eps
        kv = plain_linear(rows.flatten(-2), f"layers.{layer}.engram.wkv", engram.wkv)  # (B, S, (hc + 1) * dim)
        key = kv[..., : hc * dim].unflatten(-1, (hc, dim))
        value = kv[..., hc * dim:].unsqueeze(-2)
        rstd = torch.rsqrt(plus_eps(X.square().mean(-1), eps)) * torch.rsqrt(plus_eps(key.square().mean(-1), eps))
        dot = (X * (engram.q_weight.float() * engram.k_weight.float()) * key).sum(-1) * rstd * dim ** -0.5
        root = dot.abs().clamp_min(GATE_FLOOR).sqrt()
        # copysign(root, dot) without Sign/CopySign ops: 1 / dot < 0 is dot's sign bit, -0.0 included
        gate = torch.sigmoid(torch.where(torch.reciprocal(dot) < 0, -root, root))
        return X + gate.unsqueeze(-1) * value

    def _moe(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts[layer]
        act = experts.activations(experts.up(experts.gemm_input(x)), experts.routing_weights(x))
        return self.comm.all_reduce(experts.down(experts.gemm_input(act)), "ffn")

    def _attention(self, l: int, x: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor, win: torch.Tensor,
                   sources: dict[int, _Source], ropes: RopeKinds, ctx: dict[str, torch.Tensor],
                   ring_rows: list[torch.Tensor]) -> torch.Tensor:
        cfg, W = self.cfg, self.cfg.window_size
        attn = self.attentions[l]
        prefix = f"layers.{l}.attn"
        q, qr, kv, tables = query_and_latent(attn, x, ropes, positions, l, plain_linear, prefix)
        ring_rows.append(kv)
        scale = cfg.head_dim ** -0.5
        if cfg.compress_ratios[l] == 0:
            o = swa_replay_attention(q, torch.cat((ring, kv), 1), win, attn.attn_sink, scale)
            return output_projection(attn, o, tables, ropes, plain_linear, prefix)
        if l in self.layout.sources:
            self._write_source(l, x, positions, sources[l], ropes)
        if l in cfg.index_source_layers:
            self._select(l, x, qr, positions, sources[l], ropes, ctx)
        src = sources[cfg.kv_source_of(l)]
        assert src.new_kv is not None
        local = torch.cat((ring, kv, src.new_kv), 1)  # (B, W + S + M, D)
        topk, used = ctx["topk"], src.used.view(-1, 1, 1)
        new_row = W + kv.shape[1] + (topk - used)  # entries of this step live in the local table
        rows = torch.where(topk < 0, topk, torch.where(topk < used, topk + local.shape[1], new_row))
        o = sparse_global_attention(q, local, src.kv, torch.cat((win, rows), -1), attn.attn_sink, scale,
                                    window=win.shape[-1])
        return output_projection(attn, o, tables, ropes, plain_linear, prefix)

    def _write_source(self, l: int, x: torch.Tensor, positions: torch.Tensor, src: _Source, ropes: RopeKinds) -> None:
        """This step's compressed entries of source l (and, for ratio 2, the token left without a partner)."""
        cfg = self.cfg
        attn = self.attentions[l]
        comp = attn.compressor
        kv = x @ comp.wkv.weight.float().t()
        if self.layout.ratio[l] == 1:
            latent, entry_pos, key = rms_norm(kv, comp.norm.weight, cfg.norm_eps), positions, 0
        else:
            B, S, D = kv.shape
            M = (S + 1) // 2
            score = x @ comp.wgate.weight.float().t()
            assert src.pending is not None
            pad = torch.zeros(B, 1, D, device=kv.device)
            seq_kv = torch.cat((src.pending[:, :1], kv, pad), 1)  # (B, S + 2, D)
            seq_score = torch.cat((src.pending[:, 1:], score, pad), 1)
            # the stored token pairs with this step's first one when start is odd: start reading at 1 - start % 2
            take = ((1 - positions[:, :1] % 2)
                    + torch.arange(2 * M, device=kv.device).unsqueeze(0)).unsqueeze(-1).expand(B, 2 * M, D)
            groups_kv = torch.gather(seq_kv, 1, take).view(B, M, 2, D)
            groups_w = torch.softmax(torch.gather(seq_score, 1, take).view(B, M, 2, D), dim=2)
            latent = rms_norm((groups_kv * groups_w).sum(2), comp.norm.weight, cfg.norm_eps)
            entry_pos = (src.used.unsqueeze(1) + torch.arange(M, device=kv.device).unsqueeze(0)) * 2
            # every token's pair, not only the last: a row that keeps a prefix of the step (a speculative block cut
            # at the first rejected draft) keeps the pair of its own last token as pending
            src.pending_rows, key = torch.stack((kv, score), 2), l + 1
        ix = attn.indexer
        keys = rms_norm(latent @ ix.wk.weight.float().t(), ix.k_norm.weight, cfg.norm_eps)
        src.new_index_k = FakeQuant.index(
            ropes.apply(keys, ropes.tables(entry_pos, l, cfg.index_head_dim, key=key)), cfg)
        src.new_kv = FakeQuant.global_kv(ropes.apply(latent, ropes.tables(entry_pos, l, cfg.head_dim, key=key)), cfg)

    def _select(self, l: int, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, src: _Source,
                ropes: RopeKinds, ctx: dict[str, torch.Tensor]) -> None:
        """Index scores over the store in absolute entry order (stored entries, then this step's), top-k, and at layer E
        the candidate-block pool."""
        cfg = self.cfg
        attn, prefix, ratio = self.attentions[l], f"layers.{l}.attn", self.layout.ratio[l]
        assert src.new_index_k is not None
        old = index_scores(attn, x, qr, src.index_k, ropes, positions, l, plain_linear, prefix)  # (B, S, N)
        new = index_scores(attn, x, qr, src.new_index_k, ropes, positions, l, plain_linear, prefix)  # (B, S, M)
        B, S, N = old.shape
        M = new.shape[-1]
        t = torch.arange(N, device=old.device).view(1, 1, N)
        offset = t - src.used.view(B, 1, 1)  # position of entry t among this step's new entries
        from_new = torch.gather(new, 2, offset.clamp(0, M - 1).expand(B, S, N))
        neg_inf = torch.full_like(old, float("-inf"))
        scores = torch.where(offset < 0, old, torch.where(offset < M, from_new, neg_inf))
        scores = torch.where(visible(positions, N, ratio), scores, neg_inf)
        if l == cfg.candidate_source_layer:
            ctx["candidates"] = candidate_blocks(scores, positions, ratio, cfg.candidate_block_size,
                                                 cfg.candidate_topk_blocks)
        ctx["topk"] = select_top(scores, cfg.index_topk)
