"""The sharded pieces of a tensor-parallel CED network, each ending in the collective the release puts there.

Each class keeps the parameter names (and so the checkpoint names) of the module it stands in for, and holds only the
rank's slice (`layout.py` says which). The arithmetic between the collectives is the single-process code's: a rank
computes the same per-head / per-channel / per-expert values, only fewer of them, and the partial sums meet in one
reduction (`comm.py`), which is why the logits agree with `CEDNetwork` to float rounding of that last sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ced.model.attention import Attention, Indexer
from ced.model.config import CEDConfig
from ced.model.moe import Expert, Gate
from ced.model.primitives import ActQuantLinear
from ced.parallel.comm import Comm
from ced.parallel.layout import SHARED_EXPERT_OWNER, ParallelLayout


def rank_config(cfg: CEDConfig, layout: ParallelLayout) -> CEDConfig:
    """The config an attention layer of this rank is built from: its share of query heads, output groups and indexer
    heads (everything else is global). Heads split with whole groups, so the grouped wo_a needs no communication."""
    N = layout.world
    if N == 1:
        return cfg
    return cfg.replace(name=f"{cfg.name}@tp{N}", n_heads=cfg.n_heads // N, o_groups=cfg.o_groups // N,
                       index_n_heads=cfg.index_n_heads // N)


class _MaskedRows(nn.Module):
    """Rows [start, stop) of a table split by row; a lookup zeroes ids outside the slice and sums over the ranks, so
    exactly one rank contributes each row and the sum is exact (x + 0 == x)."""

    def __init__(self, start: int, stop: int, width: int, comm: Comm, tag: str) -> None:
        super().__init__()
        self.start, self.stop, self.comm, self.tag = start, stop, comm, tag
        self.weight = nn.Parameter(torch.empty(stop - start, width))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        outside = (ids < self.start) | (ids >= self.stop)
        if self.weight.shape[0] == 0:  # a ceil split can leave the last ranks no rows
            rows = self.weight.new_zeros(*ids.shape, self.weight.shape[1])
        else:
            rows = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0), self.tag)


class VocabParallelEmbedding(_MaskedRows):
    """`embed`: rows [start, stop) of the vocabulary; all-reduce of the masked lookup (the release's
    ParallelEmbedding). Returns the weight's dtype, as nn.Embedding does."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lookup(tokens)


class ParallelEngramTable(_MaskedRows):
    """An Engram table's rows [start, stop) (ceil split); same lookup as `EngramTable` (rows as float32)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids).float()


class RowParallelLinear(ActQuantLinear):
    """A projection whose input features are split: a partial product per rank, summed in fp32 (as the release's
    RowParallelLinear does), then cast to the input's dtype. Used for attention's `wo_b`, which makes the all-reduce
    after attention the end of `Attention.forward`."""

    def __init__(self, in_features: int, out_features: int, quantize_input: bool, comm: Comm, tag: str) -> None:
        super().__init__(in_features, out_features, quantize_input)
        self.comm, self.tag = comm, tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(self.gemm_input(x), self.weight).float()
        return self.comm.all_reduce(partial, self.tag).to(x.dtype)


class ParallelIndexer(Indexer):
    """The lightning indexer with this rank's query heads; the per-head weighted ReLU scores are summed over the
    ranks before masking and top-k (the release all-reduces `index_score` the same way). The scale uses the global
    head count, so each head's contribution is the single-process one."""

    def __init__(self, local_cfg: CEDConfig, owns_keys: bool, total_heads: int, comm: Comm) -> None:
        super().__init__(local_cfg, owns_keys)
        self.scale_heads, self.comm = total_heads, comm

    def sum_heads(self, scores: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(scores, "index")


def parallel_attention(cfg: CEDConfig, layout: ParallelLayout, layer: int, comm: Comm) -> Attention:
    """Layer `layer`'s attention holding this rank's heads and groups; `Attention.forward` runs unchanged and ends in
    the row-parallel `wo_b`, i.e. in the all-reduce after attention."""
    local = rank_config(cfg, layout)
    attn = Attention(local, layer)
    attn.wo_b = RowParallelLinear(local.o_groups * cfg.o_lora_rank, cfg.dim, cfg.runtime_fake_quant, comm, "attn")
    if attn.is_index:
        attn.indexer = ParallelIndexer(local, cfg.owns_index_keys(layer), cfg.index_n_heads, comm)
    return attn


class ParallelMoE(nn.Module):
    """The MoE with this rank's experts: the shared expert's slice and every routed expert's slice (tensor parallel),
    or its own whole experts and, on rank 0, the whole shared expert (expert parallel; `layout.py` says why). The gate
    is replicated, so every rank picks the same experts; each rank adds the partial outputs it can compute in fp32,
    and one all-reduce after the FFN sums them."""

    def __init__(self, cfg: CEDConfig, layout: ParallelLayout, comm: Comm) -> None:
        super().__init__()
        N, quant, limit = layout.world, cfg.runtime_fake_quant, cfg.swiglu_limit
        self.comm = comm
        self.gate = Gate(cfg)
        routed_inter = cfg.moe_inter_dim if layout.expert_parallel else cfg.moe_inter_dim // N
        self.owned = tuple(layout.owned_experts(cfg))
        self.experts = nn.ModuleDict({str(e): Expert(cfg.dim, routed_inter, limit, quant) for e in self.owned})
        shared = cfg.moe_inter_dim * cfg.n_shared_experts
        self.shared_experts: Expert | None = None
        if not layout.expert_parallel:
            self.shared_experts = Expert(cfg.dim, shared // N, limit, quant)
        elif layout.rank == SHARED_EXPERT_OWNER:
            self.shared_experts = Expert(cfg.dim, shared, limit, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights = self.gate(flat)
        out = flat.new_zeros(flat.shape, dtype=torch.float32)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat).float()
        chosen = (weights > 0).any(0)
        for e in self.owned:
            if bool(chosen[e]):
                out = out + self.experts[str(e)](flat, weights[:, e]).float()
        return self.comm.all_reduce(out, "ffn").to(x.dtype).reshape(shape)
