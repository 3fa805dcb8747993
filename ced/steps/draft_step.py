"""DSpark in the engines: the decoder's `draft_main` rows and the drafter graph that turns them into a draft block.

Why split this way: DSpark's stage 0 projects the target layers' stream means (3 x dim at the release's layers 37-39)
into one `main_x` row per position. That row depends on its own position only, so the decoder step computes it once,
where the target layers' streams are (`DraftMain`, output `draft_main`), and the runtime keeps the newest
`window_size` rows per turn. The drafter graph (`DraftStep`) then reads that ring and the last sampled token and
returns the whole block's greedy drafts and confidence scores in one call: recomputing the projection over the
window every step cost as much as the rest of the drafter.

The arithmetic is `ced.model.dspark.DSpark.forward`'s (tests compare them), in the export's ops, with two
differences that the stateless reference does not need: rows are batched with their own positions and their own
number of ring rows (`main_count`; the rest of the ring is padding, masked), and drafts are always greedy (the
speculative loop verifies a one-hot proposal exactly, at any temperature:
`tritonserver_backend/sampling/speculative.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from ced.model.dspark import DSpark, DSparkStage
from ced.model.network import initial_streams
from ced.steps.common import FakeQuant, SinkhornPatterns, SublayerWiring, plain_linear
from ced.steps.graph_ops import collapse, pair_swap, rms_norm, rope_apply, rope_tables
from ced.steps.stored_weights import experts_for, head_logits
from plugins.swa_replay_attention import swa_replay_attention

DRAFT_FIELDS = ("main_x", "main_count", "last_position", "last_token")


class DraftMain(nn.Module):
    """Stage 0's projection of the target layers' stream means: (B, S, n_targets * dim) -> (B, S, dim)."""

    def __init__(self, drafter: DSpark) -> None:
        super().__init__()
        first = drafter.mtp[0]
        self.targets = tuple(drafter.spec.target_layers)
        self.proj, self.norm, self.eps = first.main_proj, first.main_norm, drafter.cfg.norm_eps

    def forward(self, means: torch.Tensor) -> torch.Tensor:
        return rms_norm(plain_linear(means, "main_proj", self.proj), self.norm.weight, self.eps)


class DraftStep(nn.Module):
    """The drafter graph. Inputs (`StepLayout.drafter_inputs`): each row's ring of `main_x` rows, oldest first
    (`main_count` of them valid, the rest padding), the position of its newest row, and the token sampled after it.
    Outputs: `draft_tokens` (B, K) greedy drafts for the K positions after `last_token`, `draft_confidence` (B, K) the
    confidence head's raw scores."""

    def __init__(self, drafter: DSpark, embed: nn.Embedding, head: nn.Linear) -> None:
        super().__init__()
        self.drafter, self.embed, self.head = drafter, embed, head
        self.cfg, self.spec = drafter.cfg, drafter.spec
        stages: list[DSparkStage] = list(drafter.mtp)  # type: ignore[arg-type]
        patterns = SinkhornPatterns(self.cfg.hc_mult, self.cfg.hc_eps)
        self.wiring = [SublayerWiring(stage.cfg, stage, patterns) for stage in stages]
        self.experts = [experts_for(stage.ffn) for stage in stages]
        self.swap = pair_swap(self.cfg.head_dim, self.cfg.rope_head_dim)

    def forward(self, main_x: torch.Tensor, main_count: torch.Tensor, last_position: torch.Tensor,
                last_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, spec = self.cfg, self.spec
        B, W = main_x.shape[0], main_x.shape[1]
        K = spec.block_size
        slot = torch.arange(W).unsqueeze(0)  # (1, W)
        valid = slot < main_count.unsqueeze(1)
        main_positions = torch.where(valid, last_position.unsqueeze(1) - main_count.unsqueeze(1) + 1 + slot, 0)
        block_positions = last_position.unsqueeze(1) + 1 + torch.arange(K).unsqueeze(0)  # (B, K)
        # every block query reads the valid ring rows, then all K block rows (no causal mask inside the block)
        ring_rows = torch.where(valid, slot, -1).unsqueeze(1).expand(B, K, W)
        own_rows = (W + torch.arange(K)).view(1, 1, K).expand(B, K, K)
        rows = torch.cat((ring_rows, own_rows), -1)
        noise = torch.full((B, K - 1), spec.noise_token_id, dtype=last_token.dtype)
        block = torch.cat((last_token.unsqueeze(1), noise), 1)
        X, pre = initial_streams(self.embed, block, cfg.hc_mult)
        X = X.float()
        main = main_x.float()
        for s, wiring in enumerate(self.wiring):
            attend = lambda x, s=s: self._attention(s, x, main, main_positions, block_positions, rows)  # noqa: E731
            X, attn_pre = wiring.attention(X, pre, attend)
            X, pre = wiring.ffn(X, attn_pre, lambda x, s=s: self._moe(s, x))
        last = self.drafter.mtp[-1]
        h = collapse(X, pre)  # (B, K, dim)
        logits = head_logits(rms_norm(h, last.norm.weight, cfg.norm_eps), self.head.weight)  # (B, K, vocab)
        previous = last_token
        tokens, embeds = [], []
        for i in range(K):  # each draft's Markov bias reads the draft before it
            bias, e = last.markov_head(previous)
            previous = (logits[:, i] + bias).argmax(-1)
            tokens.append(previous)
            embeds.append(e)
        return torch.stack(tokens, 1), last.confidence_head(h, torch.stack(embeds, 1))

    def _keys(self, attn: nn.Module, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        kv = rms_norm(plain_linear(x, "wkv", attn.wkv), attn.kv_norm.weight, self.cfg.norm_eps)
        return FakeQuant.window_kv(rope_apply(kv, *tables, self.swap), self.cfg)

    def _attention(self, s: int, x: torch.Tensor, main: torch.Tensor, main_positions: torch.Tensor,
                   block_positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        attn = self.drafter.mtp[s].attn
        B, K = x.shape[0], x.shape[1]
        H, D, rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        block_tables = rope_tables(block_positions, attn.inv_freq, D, rd)
        table = torch.cat((self._keys(attn, main, rope_tables(main_positions, attn.inv_freq, D, rd)),
                           self._keys(attn, x, block_tables)), 1)
        qr = rms_norm(plain_linear(x, "wq_a", attn.wq_a), attn.q_norm.weight, cfg.norm_eps)
        cos, sin = block_tables
        q = rope_apply(plain_linear(qr, "wq_b", attn.wq_b).view(B, K, H, D),
                       cos.unsqueeze(-2), sin.unsqueeze(-2), self.swap)
        o = swa_replay_attention(q, table, rows, attn.attn_sink, D ** -0.5)
        o = rope_apply(o, cos.unsqueeze(-2), sin.unsqueeze(-2), self.swap, inverse=True)
        G = cfg.o_groups
        wo_a = attn.wo_a.weight.float().view(G, cfg.o_lora_rank, -1).transpose(1, 2)  # (G, HD/G, o_rank)
        o = (o.reshape(B, K, G, 1, H * D // G) @ wo_a).reshape(B, K, G * cfg.o_lora_rank)
        return plain_linear(o, "wo_b", attn.wo_b)

    def _moe(self, s: int, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts[s]
        act = experts.activations(experts.up(experts.gemm_input(x)), experts.routing_weights(x))
        return experts.down(experts.gemm_input(act))
