"""One decoder step for a batch of rows: layer E's FFN, layers E+1..L-1, final norm and head, LoRA as inputs.

Rows may carry different adapters: the adapter bank enters as stacked tensors (slot 0 = base, all zeros) and each
row picks its slot, so one graph serves every adapter and a batch mixes them (Punica/SGMV-style, beyond TensorRT-
Edge-LLM's one adapter per batch). A row is either a bounded replay (S = the last W hand-over rows, rings empty:
`ring_start = start`) or decode steps on its adapter's rings. The global mirror already holds this step's entries.
"""

from __future__ import annotations

import torch
from torch import nn

from ced.model.attention import window_rows
from ced.model.network import DecoderEngine
from ced.steps.common import (
    FakeQuant,
    RopeKinds,
    StepModule,
    SublayerWiring,
    output_projection,
    pooled_top,
    query_and_latent,
)
from ced.steps.draft_step import DraftMain
from ced.steps.graph_ops import chunk_positions, collapse, rms_norm, window_ring_positions
from ced.steps.layout import LoraGroup
from ced.steps.stored_weights import experts_for, head_logits, stored_chunks
from plugins.sparse_global_attention import sparse_global_attention


class LoraInputs:
    """The adapter bank of one call, by group name, and where each position's LoRA product is computed.

    Why a grid instead of each row's own copy of its adapter: gathering the bank by row (`index_select` per row)
    copied a whole adapter for every row of every group (1.8 MB a row for the embedded default), and each row's
    product then ran as a GEMM of its own: together the largest growth of a 16-row step over one row. Instead the
    slots the batch uses (`lora_used`) are gathered once, the positions of each slot are gathered into that slot's
    row of a grid (`lora_rows`, padded by repeating a position), every LoRA product runs as one GEMM per used slot,
    and each position reads its result back from the grid (`lora_at`). The grid is built by
    `ced.steps.lora_grid`.

    Batch invariance: a slot's GEMM has at least two rows (the grid pads to two), and onnxruntime's CPU GEMM gives a
    row the same bits for any row count from two up (docs/load.md: a single row takes another path when the right-
    hand matrix is an input). So a position's result depends only on its own input and its adapter, alone or in any
    batch, whichever slots and positions share the call."""

    def __init__(self, groups: list[LoraGroup], used: torch.Tensor, rows: torch.Tensor, at: torch.Tensor,
                 bank: tuple[torch.Tensor, ...]) -> None:
        self.by_module: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows, self.at = rows, at
        for i, g in enumerate(groups):
            a, b = bank[2 * i].index_select(0, used), bank[2 * i + 1].index_select(0, used)  # (U, ...)
            if g.kind == "linear":
                self.by_module[g.modules[0]] = (a, b)
            else:
                self.experts[g.name] = (a, b)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (U, C, ...): each used slot's positions."""
        U, C = self.rows.shape
        return x.flatten(0, 1).index_select(0, self.rows.flatten()).view(U, C, *x.shape[2:])

    def scatter(self, grid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """(U, C, ...) -> (B, S, ...): each position's result, read from its slot's row of the grid."""
        return grid.flatten(0, 1).index_select(0, self.at.flatten()).view(*like.shape[:2], *grid.shape[2:])

    def linear(self, x: torch.Tensor, name: str, module: nn.Linear) -> torch.Tensor:
        """x (B, S, in) -> x W^T + (x A) B for each position's adapter (B already carries alpha / r).

        Under the runtime fake-quant the base GEMM reads fp8-quantized x where the reference module does; the LoRA
        product always reads x itself (adapters are ours, trained on unquantized activations; see `ActQuantLinear`)."""
        base = FakeQuant.gemm_input(x, module) @ module.weight.float().t()
        if name not in self.by_module:
            return base
        a, b = self.by_module[name]  # (U, in, R), (U, R, out)
        return base + self.scatter((self.gather(x) @ a) @ b, x)


class DecoderStep(StepModule):
    """`draft_main` (a model with a DSpark drafter): the step also returns each position's `main_x` row, stage 0's
    projection of the target layers' stream means (`draft_step.DraftMain`), for the runtime's draft ring."""

    def __init__(self, engine: DecoderEngine, draft_main: DraftMain | None = None) -> None:
        super().__init__(engine)
        cfg = self.cfg
        self.draft_main = draft_main
        if draft_main is not None and min(draft_main.targets) <= cfg.first_decoder_layer:
            raise ValueError(f"DSpark target layers {list(draft_main.targets)} must lie after layer "
                             f"{cfg.first_decoder_layer}: the decoder step sees the streams entering layers "
                             f"{cfg.first_decoder_layer + 1}..{cfg.n_layers - 1} only")
        self.groups = self.layout.lora_groups()
        layers = range(self.E, cfg.n_layers)
        self.wiring = {l: SublayerWiring(cfg, engine.layers[str(l)], self.patterns) for l in layers}
        self.experts = {l: experts_for(engine.layers[str(l)].ffn) for l in layers}
        self.expert_chunks = stored_chunks(self.experts)
        self.attentions = {l: engine.layers[str(l)].attn for l in layers if l > self.E}

    def forward(self, streams: torch.Tensor, ffn_pre: torch.Tensor, topk: torch.Tensor, candidates: torch.Tensor,
                start: torch.Tensor, ring_start: torch.Tensor, rings: torch.Tensor, kv: torch.Tensor,
                index_k: torch.Tensor, lora_used: torch.Tensor,
                lora_rows: torch.Tensor, lora_at: torch.Tensor, verify: torch.Tensor,
                *lora_bank: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg, E, W = self.cfg, self.E, self.cfg.window_size
        S = streams.shape[1]
        lora = LoraInputs(self.groups, lora_used, lora_rows, lora_at, lora_bank)
        positions = chunk_positions(start, S, streams)
        win = window_rows(window_ring_positions(start, ring_start, W), positions, W, ring_start)
        ropes = RopeKinds(cfg, self.attentions)
        ctx = {"topk": topk}
        ring_rows: list[torch.Tensor] = []
        targets = () if self.draft_main is None else self.draft_main.targets
        means: list[torch.Tensor] = []

        X, pre = self.wiring[E].ffn(streams.float(), ffn_pre.float(), lambda x: self._moe(E, x, lora))
        for l in range(E + 1, cfg.n_layers):
            if l in targets:  # DSpark reads the streams entering its target layers, averaged over the copies
                means.append(X.mean(2))
            run = lambda x, l=l: self.comm.all_reduce(  # noqa: E731
                self._attention(l, x, rings[:, l - E - 1], positions, win, kv, index_k, candidates, ropes, lora, ctx,
                                ring_rows), "attn")
            X, attn_pre = self.wiring[l].attention(X, pre, run)
            X, pre = self.wiring[l].ffn(X, attn_pre, lambda x, l=l: self._moe(l, x, lora))
        # the last position and the positions a speculative step verifies go through the norm and head together:
        # one pass over the head (a narrow stored head is cast once per step) and row by row the same arithmetic
        # (a position's logits do not depend on which others are asked for)
        B, K = verify.shape
        picked_x = torch.gather(X, 1, verify.view(B, K, 1, 1).expand(B, K, *X.shape[2:]))
        picked_pre = torch.gather(pre, 1, verify.view(B, K, 1).expand(B, K, pre.shape[2]))
        rows = rms_norm(collapse(torch.cat((X[:, -1:], picked_x), 1), torch.cat((pre[:, -1:], picked_pre), 1)),
                        self.engine.norm.weight, cfg.norm_eps)  # (B, 1 + K, dim)
        logits = self.comm.all_gather(head_logits(rows, self.engine.head.weight), -1, "head")  # a rank's vocab rows
        if self.draft_main is None:
            return logits[:, 0], logits[:, 1:], torch.stack(ring_rows, 1)
        return logits[:, 0], logits[:, 1:], torch.stack(ring_rows, 1), self.draft_main(torch.cat(means, -1))

    def _moe(self, layer: int, x: torch.Tensor, lora: LoraInputs) -> torch.Tensor:
        """Dense experts with each row's adapter on every expert's w1/w3 and w2 (LoRA on unquantized inputs)."""
        experts = self.experts[layer]
        G, inter = experts.count, experts.inter
        h13 = experts.up(experts.gemm_input(x))  # (B, S, G*2*I)
        a13, b13 = lora.experts[f"layers.{layer}.ffn.experts_w13"]  # (U, dim, 2G, R), (U, 2G, R, I)
        U, C = lora.rows.shape
        u = (lora.gather(x) @ a13.flatten(2)).view(U, C, 2 * G, -1).transpose(1, 2)  # (U, 2G, C, R)
        h13 = h13 + lora.scatter((u @ b13).transpose(1, 2).reshape(U, C, 2 * G * inter), x)
        act = experts.activations(h13, experts.routing_weights(x))  # (B, S, G*I)
        a2, b2 = lora.experts[f"layers.{layer}.ffn.experts_w2"]  # (U, G, I, R), (U, G, R, dim)
        # (U, C, G*R)
        v = (lora.gather(act).view(U, C, G, inter).transpose(1, 2) @ a2).transpose(1, 2).reshape(U, C, -1)
        return self.comm.all_reduce(experts.down(experts.gemm_input(act)) + lora.scatter(v @ b2.flatten(1, 2), x),
                                    "ffn")

    def _attention(self, l: int, x: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor, win: torch.Tensor,
                   kv_store: torch.Tensor, index_store: torch.Tensor, candidates: torch.Tensor, ropes: RopeKinds,
                   lora: LoraInputs, ctx: dict[str, torch.Tensor],
                   ring_rows: list[torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        attn, prefix = self.attentions[l], f"layers.{l}.attn"
        q, qr, kv, tables = query_and_latent(attn, x, ropes, positions, l, lora.linear, prefix)
        ring_rows.append(kv)
        if cfg.is_reindex_layer(l):  # its own queries against layer E's keys, inside layer E's candidate pool
            ctx["topk"] = pooled_top(attn, x, qr, index_store, candidates, ropes, positions, l, lora.linear, prefix)
        local = torch.cat((ring, kv), 1)
        topk = ctx["topk"]
        rows = torch.cat((win, torch.where(topk < 0, topk, topk + local.shape[1])), -1)
        o = sparse_global_attention(q, local, kv_store, rows, attn.attn_sink, cfg.head_dim ** -0.5,
                                    window=win.shape[-1])
        return output_projection(attn, o, tables, ropes, lora.linear, prefix)
