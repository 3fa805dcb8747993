"""V4.1 attention: shared K=V latent, sliding window + sparse global KV, compressor, lightning indexer.

One `Attention` class serves every layer; what a layer does (SWA only, KV source, index owner, re-index, reuse)
comes from the config's roles. Within a step, layers talk through a `StepContext`: KV sources publish their
updated caches there, index layers publish their top-k and (layer 20) the candidate pool, and the layers below
reuse them, which is exactly the data the encoder hands to the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ced.model.config import CEDConfig
from ced.model.primitives import ActQuantLinear, RMSNorm, apply_rope_tail, rope_angles, rope_inv_freq
from ced.model.quant_formats import fp4_qdq_e4m3, fp4_qdq_ue8m0, fp8_qdq
from ced.model.state import SourceCache, WindowRing
from plugins.sparse_global_attention import sparse_global_attention
from plugins.swa_replay_attention import swa_replay_attention


@dataclass
class StepContext:
    """Values passed between the layers of one step (never stored across steps)."""

    positions: torch.Tensor  # (S,) int64
    sources: dict[int, SourceCache]  # caches after this step's writes
    topk: torch.Tensor | None = None  # (B, S, K) current index selection, -1 padded
    candidates: torch.Tensor | None = None  # (B, S, C) candidate blocks of the pool source
    records: dict[str, torch.Tensor] = field(default_factory=dict)  # hand-over pieces recorded on the way

    @property
    def start_pos(self) -> int:
        return int(self.positions[0]) if self.positions.numel() else 0


def select_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best scores per row, -1 where fewer than k are finite.

    A stable descending sort breaks exact ties by the lower index, so chunked and one-pass computation pick the
    same entries whenever their scores agree (ReLU index scores are often exactly 0).
    """
    n = scores.shape[-1]
    values, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, idx = values[..., :k], idx[..., :k]
    idx = torch.where(values > float("-inf"), idx, torch.full_like(idx, -1))
    if n < k:
        idx = torch.cat((idx, idx.new_full((*idx.shape[:-1], k - n), -1)), -1)
    return idx


def selection_mask(idx: torch.Tensor, n: int) -> torch.Tensor:
    """(…, K) indices with -1 padding -> (…, n) boolean mask."""
    safe = torch.where(idx < 0, torch.full_like(idx, n), idx)
    mask = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, safe, True)
    return mask[..., :n]


def window_rows(ring_pos: torch.Tensor, positions: torch.Tensor, window: int,
                first: torch.Tensor | None = None) -> torch.Tensor:
    """Each query's sliding window as rows of the local table [ring (W slots) ; this chunk (S rows)].

    ring_pos (B, W) int64 is the position each ring slot holds (-1 = empty); positions (B, S) are the chunk's
    positions, consecutive from its start; `first` (B,) the first position that exists (default 0: a replay padded
    at the front has inert rows before it). Returns (B, S, W) int64: for the query at p, entry j names the row of
    position p - W + 1 + j (oldest first): a chunk row when that position is in this chunk, its ring slot
    (position % W) when the ring holds exactly that position, -1 otherwise.
    """
    B, S = positions.shape
    start = positions[:, :1].unsqueeze(-1)  # (B, 1, 1)
    want = positions.unsqueeze(-1) - (window - 1) + torch.arange(window, device=positions.device)  # (B, S, W)
    exists = want >= (0 if first is None else first.view(B, 1, 1))
    slot = want.remainder(window)
    held = torch.gather(ring_pos, 1, slot.reshape(B, S * window)).view(B, S, window)
    rows = torch.where(want >= start, want - start + window, torch.where(held == want, slot, torch.full_like(slot, -1)))
    return torch.where(exists, rows, torch.full_like(rows, -1))


def visible_entries(positions: torch.Tensor, n: int, ratio: int) -> torch.Tensor:
    """(S, n) mask: compressed entry t is visible to the query at position p iff t < (p + 1) // ratio."""
    t = torch.arange(n, device=positions.device)
    return t.unsqueeze(0) < ((positions + 1) // ratio).unsqueeze(1)


def select_candidate_blocks(scores: torch.Tensor, positions: torch.Tensor, ratio: int, block: int,
                            n_blocks: int) -> torch.Tensor:
    """Layer 20's candidate pool: the best `n_blocks` blocks of `block` entries by max score, newest block pinned.

    scores: (B, S, N) with -inf on invisible entries. Returns (B, S, n_blocks) block ids, -1 padded. Pinning the
    block of the newest visible entry guarantees the re-index layers always see the most recent history.
    """
    B, S, N = scores.shape
    nb = -(-N // block)
    padded = torch.cat((scores, scores.new_full((B, S, nb * block - N), float("-inf"))), -1)
    block_scores = padded.view(B, S, nb, block).amax(-1)
    newest = (positions + 1) // ratio - 1  # (S,)
    has_newest = (newest >= 0).view(1, S, 1)
    pin = torch.arange(nb, device=scores.device).view(1, 1, nb) == (newest // block).clamp(min=0).view(1, S, 1)
    block_scores = torch.where(pin & has_newest, torch.full_like(block_scores, float("inf")), block_scores)
    return select_top(block_scores, n_blocks)


def candidate_entry_mask(candidates: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """(B, S, C) block ids -> (B, S, n) mask of the entries inside those blocks."""
    nb = -(-n // block)
    block_mask = selection_mask(candidates, nb)
    return block_mask.repeat_interleave(block, dim=-1)[..., :n]


class Compressor(nn.Module):
    """Writes a KV source's global entries: plain projection (ratio 1) or gated pooling of token pairs (ratio 2).

    Its projections are plain Linears: the release keeps them in bf16 (ratio 1) or fp32 (ratio 2), so their input
    is never activation-quantized.
    """

    def __init__(self, cfg: CEDConfig, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(cfg.dim, cfg.head_dim, bias=False)
        if ratio > 1:
            self.wgate = nn.Linear(cfg.dim, cfg.head_dim, bias=False)
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cache: SourceCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, S, dim) -> (new pre-RoPE latents (B, n, D), new pending kv, new pending score).

        Ratio 2 pools each complete pair with a per-channel softmax over the two tokens' gate scores, in fp32; the
        leftover token waits in the pending state until its partner arrives.
        """
        kv = self.wkv(x).float()
        if self.ratio == 1:
            return self.norm(kv.to(x.dtype)), cache.pending_kv, cache.pending_score
        score = self.wgate(x).float()
        kv = torch.cat((cache.pending_kv.float(), kv), 1)
        score = torch.cat((cache.pending_score.float(), score), 1)
        B, T, D = kv.shape
        n = T // self.ratio
        used = n * self.ratio
        groups_kv = kv[:, :used].view(B, n, self.ratio, D)
        groups_w = torch.softmax(score[:, :used].view(B, n, self.ratio, D), dim=2)
        pooled = (groups_kv * groups_w).sum(2)
        # back to the stream's dtype before the norm, as the release does (a no-op in fp32; bf16 keys need bf16)
        return self.norm(pooled.to(x.dtype)), kv[:, used:], score[:, used:]


class Indexer(nn.Module):
    """Lightning indexer: ReLU-weighted multi-head scores of a query against compressed index keys, then top-k.

    wq_b is an fp8 weight in the release (its input is activation-quantized under the runtime fake-quant);
    weights_proj and wk are bf16 there, so they read their inputs unquantized.
    """

    def __init__(self, cfg: CEDConfig, owns_keys: bool) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.scale_heads = cfg.index_n_heads  # the head count the scores are scaled by (all heads, also when split)
        self.wq_b = ActQuantLinear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, cfg.runtime_fake_quant)
        self.weights_proj = nn.Linear(cfg.dim, cfg.index_n_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(cfg.head_dim, cfg.index_head_dim, bias=False)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.norm_eps)

    def keys(self, latent: torch.Tensor) -> torch.Tensor:
        """Index keys from the compressor's pre-RoPE latent (B, n, D) -> (B, n, Di), before RoPE."""
        return self.k_norm(self.wk(latent))

    def scores(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               rope_dim: int, quant: bool) -> torch.Tensor:
        """(B, S, N) index scores: sum_h relu(q_h . k_t) * w_h."""
        B, S, _ = x.shape
        q = self.wq_b(qr).view(B, S, self.n_heads, self.head_dim)
        q = apply_rope_tail(q, cos.unsqueeze(1), sin.unsqueeze(1), rope_dim)
        if quant:
            q = fp4_qdq_ue8m0(q)
        w = self.weights_proj(x).float() * (self.head_dim ** -0.5 * self.scale_heads ** -0.5)
        logits = torch.einsum("bshd,bnd->bshn", q.float(), keys.float()).relu()
        return self.sum_heads((logits * w.unsqueeze(-1)).sum(2))

    def sum_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores summed over this module's heads are the scores (a tensor-parallel indexer adds the other
        ranks' heads here: ced/parallel)."""
        return scores


class Attention(nn.Module):
    """One layer's attention; its role (SWA / source / index / re-index / reuse) is fixed by the config.

    wq_a, wq_b, wkv (the window latent) and wo_b are fp8 weights in the release, so under the runtime fake-quant
    their GEMMs read fp8-quantized inputs (`ActQuantLinear`); wo_a is dequantized to bf16 by the release's converter
    and runs as a grouped einsum on the unquantized attention output, so it stays a plain Linear.
    """

    def __init__(self, cfg: CEDConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ratio = cfg.compress_ratios[layer]
        H, D, quant = cfg.n_heads, cfg.head_dim, cfg.runtime_fake_quant
        self.wq_a = ActQuantLinear(cfg.dim, cfg.q_lora_rank, quant)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = ActQuantLinear(cfg.q_lora_rank, H * D, quant)
        self.wkv = ActQuantLinear(cfg.dim, D, quant)
        self.kv_norm = RMSNorm(D, cfg.norm_eps)
        self.wo_a = nn.Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = ActQuantLinear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, quant)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.is_source = layer in cfg.kv_source_layers
        self.is_index = layer in cfg.index_source_layers
        if self.is_source:
            self.compressor = Compressor(cfg, self.ratio)
        if self.is_index:
            self.indexer = Indexer(cfg, cfg.owns_index_keys(layer))
        theta = cfg.compress_rope_theta if self.ratio > 0 else cfg.rope_theta
        yarn = cfg.yarn_original_seq_len if cfg.uses_yarn(layer) else 0
        inv = rope_inv_freq(cfg.rope_head_dim, theta, yarn, cfg.yarn_factor, cfg.yarn_beta_fast, cfg.yarn_beta_slow)
        self.inv_freq = inv  # a plain CPU tensor, not a buffer: derived from the config, never loaded or saved

    # ---------------------------------------------------------------- global KV
    def _write_source(self, x: torch.Tensor, ctx: StepContext) -> None:
        """Compress this step's tokens into new global entries and publish the updated cache on the context."""
        cfg, r = self.cfg, self.ratio
        cache = ctx.sources[self.layer]
        first_entry = cache.n_entries
        latent, pending_kv, pending_score = self.compressor(x, cache)
        n = latent.shape[1]
        entry_pos = (first_entry + torch.arange(n, device=x.device)) * r  # RoPE at each group's first token
        cos, sin = rope_angles(entry_pos, self.inv_freq)
        index_k = cache.index_k
        if cache.index_k is not None:
            keys = apply_rope_tail(self.indexer.keys(latent), cos, sin, cfg.rope_head_dim)
            if cfg.runtime_fake_quant:
                keys = fp4_qdq_ue8m0(keys)
            index_k = torch.cat((cache.index_k, keys.to(cache.index_k.dtype)), 1)
            ctx.records["index_k"] = keys
        entries = apply_rope_tail(latent, cos, sin, cfg.rope_head_dim)
        if cfg.runtime_fake_quant:
            entries = fp4_qdq_e4m3(entries)
        ctx.records["global_kv"] = entries
        ctx.sources[self.layer] = SourceCache(torch.cat((cache.kv, entries.to(cache.kv.dtype)), 1), index_k,
                                              pending_kv, pending_score)

    def _select(self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext, cos: torch.Tensor,
                sin: torch.Tensor) -> None:
        """Run this layer's indexer and publish its top-k (and, at layer 20, the candidate pool) on the context."""
        cfg, r = self.cfg, self.ratio
        key_owner = self.layer if cfg.owns_index_keys(self.layer) else cfg.candidate_source_layer
        keys = ctx.sources[key_owner].index_k
        assert keys is not None, f"layer {key_owner} owns no index keys"
        scores = self.indexer.scores(x, qr, keys, cos, sin, cfg.rope_head_dim, cfg.runtime_fake_quant)
        N = keys.shape[1]
        scores = scores.masked_fill(~visible_entries(ctx.positions, N, r).unsqueeze(0), float("-inf"))
        if self.layer == cfg.candidate_source_layer:
            ctx.candidates = select_candidate_blocks(scores, ctx.positions, r, cfg.candidate_block_size,
                                                     cfg.candidate_topk_blocks)
        elif cfg.is_reindex_layer(self.layer):
            assert ctx.candidates is not None, f"re-index layer {self.layer} runs before the candidate pool exists"
            pool = candidate_entry_mask(ctx.candidates, N, cfg.candidate_block_size)
            scores = scores.masked_fill(~pool, float("-inf"))
        ctx.topk = select_top(scores, cfg.index_topk)

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, ctx: StepContext, window: WindowRing) -> tuple[torch.Tensor, WindowRing]:
        """x: (B, S, dim) normed attention input -> (B, S, dim), and the layer's updated window ring."""
        cfg = self.cfg
        B, S, _ = x.shape
        H, D, rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        pos = ctx.positions
        cos, sin = rope_angles(pos, self.inv_freq)  # (S, rd/2)

        qr = self.q_norm(self.wq_a(x))
        q = apply_rope_tail(self.wq_b(qr).view(B, S, H, D), cos.unsqueeze(1), sin.unsqueeze(1), rd)
        kv = apply_rope_tail(self.kv_norm(self.wkv(x)), cos, sin, rd)
        if cfg.runtime_fake_quant:
            kv = fp8_qdq(kv)

        # local table: the ring's earlier positions, then this chunk; each query lists its window rows in position order
        local = torch.cat((window.kv, kv.to(window.kv.dtype)), 1)  # (B, W+S, D)
        rows = window_rows(window.pos, pos.unsqueeze(0).expand(B, S), cfg.window_size)  # (B, S, W)
        new_window = window.write(kv, pos)

        if self.ratio == 0:
            o = swa_replay_attention(q, local, rows, self.attn_sink, D ** -0.5)  # (B, S, H, D)
        else:
            if self.is_source:
                self._write_source(x, ctx)
            if self.is_index:
                self._select(x, qr, ctx, cos, sin)
            assert ctx.topk is not None, f"layer {self.layer} reuses an index selection that no layer made"
            cache = ctx.sources[cfg.kv_source_of(self.layer)]
            global_rows = torch.where(ctx.topk >= 0, ctx.topk + local.shape[1], ctx.topk)  # rows of [local ; global]
            o = sparse_global_attention(q, local, cache.kv, torch.cat((rows, global_rows), -1), self.attn_sink,
                                        D ** -0.5, window=rows.shape[-1])
        o = apply_rope_tail(o, cos.unsqueeze(1), sin.unsqueeze(1), rd, inverse=True)
        G = cfg.o_groups
        o = o.reshape(B, S, G, H * D // G)
        wo_a = self.wo_a.weight.view(G, cfg.o_lora_rank, H * D // G)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)  # grouped (block-diagonal) low-rank projection
        return self.wo_b(o.flatten(2)), new_window
