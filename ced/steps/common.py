"""Pieces both step modules use: per-layer attention projections, RoPE tables by layer kind, the sub-layer wiring,
and V4.1's runtime fake-quant at exactly the places `ced.model.attention` applies it."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ced.model.attention import Attention
from ced.model.config import CEDConfig
from ced.model.network import Block
from ced.model.primitives import ACT_QUANT_BLOCK, quantizes_input
from ced.parallel.comm import Comm
from ced.steps.graph_ops import (
    HcMix,
    SinkhornPatterns,
    collapse,
    expand,
    fp4_qdq_e4m3,
    fp4_qdq_ue8m0,
    fp8_qdq,
    hc_coefficients,
    pair_swap,
    rms_norm,
    rope_apply,
    rope_tables,
    select_top,
)
from ced.steps.layout import StepLayout


class StepModule(nn.Module):
    """What both step modules hold: the engine component (its weights), the config, the layout, the Sinkhorn patterns.

    With `cfg.runtime_fake_quant` the steps run V4.1's runtime fake-quant as the reference does (see `FakeQuant`).

    `comm`: the engine's tensor-parallel group when it is a rank's shard (`parallel.load_parallel_component`), else a
    group of one. The steps sum attention and MoE outputs and gather the head's logits through it, where DeepSeek's
    code has its all-reduces; alone every call is the identity, so the exported graphs hold no collective."""

    def __init__(self, engine: nn.Module) -> None:
        super().__init__()
        cfg: CEDConfig = engine.cfg  # type: ignore[assignment]
        self.cfg, self.engine, self.layout = cfg, engine, StepLayout(cfg)
        self.comm: Comm = getattr(engine, "comm", None) or Comm.single()
        self.E = cfg.first_decoder_layer
        self.patterns = SinkhornPatterns(cfg.hc_mult, cfg.hc_eps)


Linear = Callable[[torch.Tensor, str, nn.Linear], torch.Tensor]  # (x, module name, base Linear) -> x W^T (+ LoRA)


class FakeQuant:
    """V4.1's runtime fake-quant in the steps' exportable ops (`graph_ops`, bit for bit `quant_formats`), each one the
    identity when the config has it off, so the graphs without it are exactly what they were.

    Where, as in the reference: the window KV latent after RoPE in fp8 (ue8m0 per 32), the new global-KV entries after
    RoPE in fp4 with e4m3 scales per 16, indexer queries and keys after RoPE in fp4 (ue8m0 per 32), and the input of
    each GEMM against a released fp8/fp4 weight in fp8 (`gemm_input`)."""

    @staticmethod
    def window_kv(kv: torch.Tensor, cfg: CEDConfig) -> torch.Tensor:
        return fp8_qdq(kv, 32) if cfg.runtime_fake_quant else kv

    @staticmethod
    def global_kv(entries: torch.Tensor, cfg: CEDConfig) -> torch.Tensor:
        return fp4_qdq_e4m3(entries, 16) if cfg.runtime_fake_quant else entries

    @staticmethod
    def index(qk: torch.Tensor, cfg: CEDConfig) -> torch.Tensor:
        return fp4_qdq_ue8m0(qk, 32) if cfg.runtime_fake_quant else qk

    @staticmethod
    def gemm_input(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        """What `module`'s base GEMM reads: fp8-quantized x exactly when the reference module quantizes it
        (`quantizes_input`: wq_a, wq_b, wkv, wo_b, indexer wq_b, experts, under the switch), else x. A LoRA product
        added to that GEMM reads the unquantized x, as in the reference (see `ActQuantLinear`)."""
        return fp8_qdq(x, ACT_QUANT_BLOCK) if quantizes_input(module) else x


def plain_linear(x: torch.Tensor, name: str, module: nn.Linear) -> torch.Tensor:
    return FakeQuant.gemm_input(x, module) @ module.weight.float().t()


class RopeKinds:
    """Cos/sin tables for one step, by layer kind (SWA layers vs compressed layers) and width (head, index head)."""

    def __init__(self, cfg: CEDConfig, attentions: dict[int, Attention]) -> None:
        self.cfg = cfg
        self.inv_freq = {l: a.inv_freq for l, a in attentions.items()}
        self.swap = {w: pair_swap(w, cfg.rope_head_dim) for w in (cfg.head_dim, cfg.index_head_dim)}
        self._cache: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def kind(self, layer: int) -> int:
        return 0 if self.cfg.compress_ratios[layer] == 0 else 1

    def tables(self, positions: torch.Tensor, layer: int, width: int,
               key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for `positions` (cached per step under `key`: 0 = the step's token positions)."""
        k = (self.kind(layer), width, key)
        if k not in self._cache:
            self._cache[k] = rope_tables(positions, self.inv_freq[layer], width, self.cfg.rope_head_dim)
        return self._cache[k]

    def apply(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], heads: bool = False,
              inverse: bool = False) -> torch.Tensor:
        cos, sin = tables
        if heads:  # x (B, S, H, width)
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return rope_apply(x, cos, sin, self.swap[x.shape[-1]], inverse)


class SublayerWiring:
    """The mHC wiring of one block's two sub-layers, with the block's coefficients precomputed per sub-layer."""

    def __init__(self, cfg: CEDConfig, block: Block, patterns: SinkhornPatterns) -> None:
        self.cfg, self.block, self.patterns = cfg, block, patterns
        hc = cfg.hc_mult
        self.mix_attn = (HcMix(block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale, hc)
                         if hasattr(block, "hc_attn_fn") else None)
        self.mix_ffn = (HcMix(block.hc_ffn_fn, block.hc_ffn_base, block.hc_ffn_scale, hc)
                        if hasattr(block, "hc_ffn_fn") else None)

    def attention(self, X: torch.Tensor, pre_prev: torch.Tensor,
                  run: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention sub-layer: its input mixes the streams with the *previous* sub-layer's pre."""
        b = self.block
        assert self.mix_attn is not None
        pre, post, C = hc_coefficients(X, self.mix_attn, self.cfg, self.patterns)
        y = run(rms_norm(collapse(X, pre_prev), b.attn_norm.weight, self.cfg.norm_eps))
        return expand(y, post, C, X), pre

    def ffn(self, X: torch.Tensor, attn_pre: torch.Tensor,
            run: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.block
        assert self.mix_ffn is not None
        pre, post, C = hc_coefficients(X, self.mix_ffn, self.cfg, self.patterns)
        y = run(rms_norm(collapse(X, attn_pre), b.ffn_norm.weight, self.cfg.norm_eps))
        return expand(y, post, C, X), pre


def query_and_latent(attn: Attention, x: torch.Tensor, ropes: RopeKinds, positions: torch.Tensor, layer: int,
                     linear: Linear,
                     prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """q (B,S,H,D) after RoPE, q's low-rank qr (B,S,q_rank), kv latent (B,S,D) after RoPE, and the head-width tables."""
    cfg = attn.cfg
    B, S = x.shape[0], x.shape[1]
    qr = rms_norm(linear(x, f"{prefix}.wq_a", attn.wq_a), attn.q_norm.weight, cfg.norm_eps)
    tables = ropes.tables(positions, layer, cfg.head_dim)
    q = ropes.apply(linear(qr, f"{prefix}.wq_b", attn.wq_b).view(B, S, cfg.n_heads, cfg.head_dim), tables, heads=True)
    kv = ropes.apply(rms_norm(linear(x, f"{prefix}.wkv", attn.wkv), attn.kv_norm.weight, cfg.norm_eps), tables)
    return q, qr, FakeQuant.window_kv(kv, cfg), tables


def index_scores(attn: Attention, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, ropes: RopeKinds,
                 positions: torch.Tensor, layer: int, linear: Linear, prefix: str) -> torch.Tensor:
    """(B, S, N) lightning-indexer scores of this step's queries against `keys` (B, N, Di): sum_h relu(q_h.k) w_h."""
    cfg = attn.cfg
    B, S = x.shape[0], x.shape[1]
    ix = attn.indexer
    q = linear(qr, f"{prefix}.indexer.wq_b", ix.wq_b).view(B, S, ix.n_heads, ix.head_dim)
    q = FakeQuant.index(ropes.apply(q, ropes.tables(positions, layer, cfg.index_head_dim), heads=True), cfg)
    w = linear(x, f"{prefix}.indexer.weights_proj", ix.weights_proj) * (ix.head_dim ** -0.5 * ix.scale_heads ** -0.5)
    logits = torch.relu(q @ keys.unsqueeze(1).transpose(-1, -2))  # (B, S, Hi, N)
    return ix.sum_heads((logits * w.unsqueeze(-1)).sum(2))  # a rank's heads: summed over the group there


def output_projection(attn: Attention, o: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], ropes: RopeKinds,
                      linear: Linear, prefix: str) -> torch.Tensor:
    """Inverse RoPE on the attention output, grouped low-rank wo_a (block-diagonal), then wo_b."""
    cfg = attn.cfg
    B, S = o.shape[0], o.shape[1]
    G = cfg.o_groups
    o = ropes.apply(o, tables, heads=True, inverse=True).reshape(B, S, G, 1, cfg.n_heads * cfg.head_dim // G)
    wo_a = attn.wo_a.weight.float().view(G, cfg.o_lora_rank, -1).transpose(1, 2)  # (G, HD/G, o_rank)
    o = (o @ wo_a).reshape(B, S, G * cfg.o_lora_rank)
    return linear(o, f"{prefix}.wo_b", attn.wo_b)


def candidate_pool_ids(candidates: torch.Tensor, block: int) -> torch.Tensor:
    """(B, S, C) candidate block ids (-1 none) -> (B, S, C * block) entry ids in ascending order, -1 for none.

    Ascending order keeps the reference's tie rule (ReLU index scores tie at exactly 0 often): among equal scores the
    lower entry id wins, which is the lower pool position once the pool is sorted. Sorted as floats through TopK
    (block ids are far below 2^24, so exact)."""
    C = candidates.shape[-1]
    ordered = torch.topk(candidates.float(), C, dim=-1, largest=False, sorted=True).values.long()
    ids = ordered.unsqueeze(-1) * block + torch.arange(block, device=candidates.device)
    return torch.where(ordered.unsqueeze(-1) < 0, torch.full_like(ids, -1), ids).flatten(-2)


def pooled_top(attn: Attention, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor,
               ropes: RopeKinds, positions: torch.Tensor, layer: int, linear: Linear, prefix: str) -> torch.Tensor:
    """A re-index layer's top-k entries (absolute ids, -1 none), scored inside layer E's candidate pool only.

    The same selection as scoring every stored entry and masking all but the pool (what the reference does), but the
    work is O(pool) per query instead of O(stored entries): a bounded replay then costs the same at 1K and 16K
    context. keys (B, N, Di) is layer E's index-key store; candidates (B, S, C) its candidate blocks."""
    cfg = attn.cfg
    B, S = x.shape[0], x.shape[1]
    ids = candidate_pool_ids(candidates, cfg.candidate_block_size)  # (B, S, P)
    P = ids.shape[-1]
    rows = ids.clamp(min=0).reshape(B, S * P, 1).expand(B, S * P, keys.shape[-1])
    pool_keys = torch.gather(keys, 1, rows).view(B, S, P, keys.shape[-1])  # (B, S, P, Di)
    ix = attn.indexer
    q = linear(qr, f"{prefix}.indexer.wq_b", ix.wq_b).view(B, S, ix.n_heads, ix.head_dim)
    q = FakeQuant.index(ropes.apply(q, ropes.tables(positions, layer, cfg.index_head_dim), heads=True), cfg)
    w = linear(x, f"{prefix}.indexer.weights_proj", ix.weights_proj) * (ix.head_dim ** -0.5 * ix.scale_heads ** -0.5)
    logits = torch.relu(q @ pool_keys.transpose(-1, -2))  # (B, S, Hi, P)
    scores = ix.sum_heads((logits * w.unsqueeze(-1)).sum(2))  # (B, S, P)
    keep = (ids >= 0) & (ids < (positions + 1).unsqueeze(-1))  # visible entries of a ratio-1 store
    picked = select_top(torch.where(keep, scores, torch.full_like(scores, float("-inf"))), min(cfg.index_topk, P))
    absolute = torch.where(picked < 0, picked, torch.gather(ids, -1, picked.clamp(min=0)))
    if P < cfg.index_topk:  # a pool smaller than k: the rest of the list is empty, as masking would leave it
        absolute = torch.cat((absolute, absolute.new_full((B, S, cfg.index_topk - P), -1)), -1)
    return absolute


def visible(positions: torch.Tensor, n: int | torch.SymInt, ratio: int) -> torch.Tensor:
    """(B, S, n): entry t visible to the query at p iff t < (p + 1) // ratio."""
    t = torch.arange(n, device=positions.device)
    return t.view(1, 1, -1) < ((positions + 1) // ratio).unsqueeze(-1)


def candidate_blocks(scores: torch.Tensor, positions: torch.Tensor, ratio: int, block: int,
                     n_blocks: int) -> torch.Tensor:
    """As `attention.select_candidate_blocks` with per-row positions; scores' length is a multiple of `block`."""
    B, S, N = scores.shape
    block_scores = scores.view(B, S, N // block, block).amax(-1)
    newest = (positions + 1) // ratio - 1
    ids = torch.arange(N // block, device=scores.device).view(1, 1, -1)
    pin = (ids == (newest // block).clamp(min=0).unsqueeze(-1)) & (newest >= 0).unsqueeze(-1)
    block_scores = torch.where(pin, torch.full_like(block_scores, float("inf")), block_scores)
    return select_top(block_scores, n_blocks)
