"""DSpark, V4.1's block drafter (`mtp.{0,1,2}.*` in the release): the forward pass the official code defines.

What it computes, for a target that has processed positions 0..t and sampled the token at t+1 (`last_token`):

1. `main_x = main_norm(main_proj(concat_l mean_copies(streams entering target layer l)))` per position, l over the
   target layers (37, 38, 39 in the release: the streams entering each block, after Engram, averaged over the hc
   copies; `CEDNetwork.forward(..., targets=...)` returns them). Stage 0 owns `main_proj`/`main_norm`; every stage
   reads the same `main_x`.
2. A block of `block_size` tokens `[last_token, noise, noise, ...]` (`noise_token_id`) at positions t+1..t+block_size,
   embedded with the target's embedding and copied onto the hc streams (pre-mix: stream 0).
3. `n_stages` blocks, each one V4.1 layer (mHC attention + MoE sub-layers with their own weights and the DSpark
   expert count / top-k) whose attention is sliding-window only (ratio 0, rope_theta without YaRN): every block query
   reads the window's `window_size` newest main positions (keys `kv_norm(wkv(main_x))` of *this* stage, RoPE at
   their positions) and all `block_size` keys of its own block (no causal mask inside the block), plus the sink.
   Each stage takes the previous stage's streams and FFN pre-mix, as consecutive backbone layers do.
4. The last stage collapses the streams with its FFN pre-mix: `h`. Logits `head(norm(h))` (the target's head, the
   stage's own `norm`), fp32. Draft i is sampled from logits i plus the Markov bias `markov_head.head(markov_head.
   embed(previous token))` (previous token: `last_token` for i = 0, else draft i-1), so drafts are sampled in order.
5. Confidence i = `confidence_head.proj([h_i, markov_embed(previous token)])`: one raw fp32 score per draft. The
   official forward applies no sigmoid; what the speculative loop does with the score is not in the official code.

The official code runs this with caches (a prefill seeds each stage's window ring from `main_x`; each decode step
adds one main position and drafts); here it is stateless: the window keys are recomputed from the `main_x` rows
given, which is the same arithmetic because each cached key depends on its own position's `main_x` alone.
Not here: the speculative loop (verification, acceptance), engines, training. See docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ced.model.attention import Attention
from ced.model.config import CEDConfig
from ced.model.dspark_spec import DSparkSpec, stage_config
from ced.model.hyper_connections import collapse, expand, hc_coefficients
from ced.model.network import Block, initial_streams
from ced.model.primitives import ActQuantLinear, RMSNorm, apply_rope_tail, rope_angles
from ced.model.quant_formats import fp8_qdq
from plugins.swa_replay_attention import swa_replay_attention


class MarkovHead(nn.Module):
    """A rank-`markov_rank` bigram: the previous token's embedding projected onto the vocabulary (fp32)."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """previous (B,) token ids -> (logit bias (B, vocab) fp32, embedding (B, rank))."""
        e = self.embed(previous)
        return nn.functional.linear(e.float(), self.head.weight.float()), e


class ConfidenceHead(nn.Module):
    """One raw fp32 score per draft from [hidden, Markov embedding]; no squashing (the official forward has none)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=False)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat((hidden, markov_embed.to(hidden.dtype)), -1).float()
        return nn.functional.linear(x, self.proj.weight.float()).squeeze(-1)


class DSparkStage(Block):
    """One DSpark block: a backbone `Block` in a sliding-window role (so its tensors carry the backbone's names), with
    the stage-0 projection of the target layers and, on the last stage, the norm and the two heads."""

    def __init__(self, cfg: CEDConfig, spec: DSparkSpec, stage: int) -> None:
        scfg = stage_config(cfg, spec)
        super().__init__(scfg, scfg.compress_ratios.index(0))  # an SWA-only layer's role: no compressor, no indexer
        self.stage = stage
        if stage == 0:
            self.main_proj = ActQuantLinear(cfg.dim * len(spec.target_layers), cfg.dim, cfg.runtime_fake_quant)
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if stage == spec.n_stages - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, spec.markov_rank)
            self.confidence_head = ConfidenceHead(cfg.dim + spec.markov_rank)

    def _keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Window-style keys of (B, N, dim) rows at `positions`: kv_norm(wkv(x)), RoPE, fp8 under the fake-quant."""
        attn = self.attn
        cos, sin = rope_angles(positions, attn.inv_freq)
        kv = apply_rope_tail(attn.kv_norm(attn.wkv(x)), cos, sin, self.cfg.rope_head_dim)
        return fp8_qdq(kv) if self.cfg.runtime_fake_quant else kv

    def attention(self, x: torch.Tensor, main_x: torch.Tensor, main_positions: torch.Tensor,
                  block_positions: torch.Tensor) -> torch.Tensor:
        """x (B, K, dim) normed block input; main_x (B, M, dim) the window's main rows (M <= window) -> (B, K, dim).

        Every block query reads all M window keys and all K block keys (its table is [window ; block]).
        """
        attn, cfg = self.attn, self.cfg
        assert isinstance(attn, Attention) and attn.ratio == 0
        B, K, _ = x.shape
        H, D, rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        table = torch.cat((self._keys(main_x, main_positions), self._keys(x, block_positions)), 1)
        cos, sin = rope_angles(block_positions, attn.inv_freq)
        q = apply_rope_tail(attn.wq_b(attn.q_norm(attn.wq_a(x))).view(B, K, H, D),
                            cos.unsqueeze(1), sin.unsqueeze(1), rd)
        rows = torch.arange(table.shape[1], device=x.device).expand(B, K, -1)
        o = swa_replay_attention(q, table.to(q.dtype), rows, attn.attn_sink, D ** -0.5)
        o = apply_rope_tail(o, cos.unsqueeze(1), sin.unsqueeze(1), rd, inverse=True)
        G = cfg.o_groups
        wo_a = attn.wo_a.weight.view(G, cfg.o_lora_rank, H * D // G)
        o = torch.einsum("bsgd,grd->bsgr", o.reshape(B, K, G, H * D // G), wo_a)
        return attn.wo_b(o.flatten(2))

    def run(self, X: torch.Tensor, pre: torch.Tensor, main_x: torch.Tensor, main_positions: torch.Tensor,
            block_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams (B, K, hc, dim) and the previous stage's FFN pre-mix -> new streams and this stage's FFN pre-mix."""
        attn_pre, post, C = hc_coefficients(X, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        y = self.attention(self.attn_norm(collapse(X, pre)), main_x, main_positions, block_positions)
        return self.ffn_sublayer(expand(y, post, C, X), attn_pre)


@dataclass
class DraftOutput:
    tokens: torch.Tensor  # (B, K) drafts for positions t+2 .. t+K+1
    logits: torch.Tensor  # (B, K, vocab) fp32, Markov bias included (logits i predict draft i)
    confidence: torch.Tensor  # (B, K) fp32 raw scores
    block: torch.Tensor  # (B, K) the block the drafter read: [last token, noise, ...]


class DSpark(nn.Module):
    """The drafter: `mtp.{i}` are its stages, so its state dict holds exactly the release's `mtp.*` names. The
    embedding and head are the target's (the release stores none under `mtp.`), passed to `forward`."""

    def __init__(self, cfg: CEDConfig, spec: DSparkSpec) -> None:
        super().__init__()
        spec.check(cfg)
        self.cfg, self.spec = cfg, spec
        self.mtp = nn.ModuleList(DSparkStage(cfg, spec, s) for s in range(spec.n_stages))

    def main_x(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, n_targets * dim) target-layer inputs -> (B, T, dim)."""
        first = self.mtp[0]
        return first.main_norm(first.main_proj(target_hidden))

    def block_tokens(self, last_token: torch.Tensor) -> torch.Tensor:
        """(B,) -> (B, block_size): the last token, then noise."""
        block = last_token.new_full((last_token.shape[0], self.spec.block_size), self.spec.noise_token_id)
        block[:, 0] = last_token
        return block

    def forward(self, target_hidden: torch.Tensor, last_token: torch.Tensor, embed: nn.Embedding, head: nn.Linear,
                start: int = 0, temperature: float = 0.0, generator: torch.Generator | None = None,
                forced: torch.Tensor | None = None) -> DraftOutput:
        """Draft `block_size` tokens after `last_token`.

        target_hidden: (B, T, n_targets * dim), the target layers' inputs (mean over copies) at positions
        start..start+T-1 = ..t; only the newest `window_size` rows are read. last_token: (B,) the token at t+1.
        temperature 0 drafts greedily; above 0 it samples from softmax(logits / temperature) with `generator`.
        forced (B, K): take these as the drafts instead of sampling (the Markov bias and confidence then condition
        on them), e.g. to score a given continuation.
        """
        spec, cfg = self.spec, self.cfg
        B, T, width = target_hidden.shape
        if width != cfg.dim * len(spec.target_layers) or T < 1 or last_token.shape != (B,):
            raise ValueError(f"target_hidden must be (B, T>=1, {cfg.dim * len(spec.target_layers)}) and last_token "
                             f"(B,), got {tuple(target_hidden.shape)} and {tuple(last_token.shape)}")
        K, device = spec.block_size, target_hidden.device
        keep = min(T, cfg.window_size)
        t = start + T - 1
        main_positions = torch.arange(t - keep + 1, t + 1, device=device)
        block_positions = torch.arange(t + 1, t + 1 + K, device=device)
        main_x = self.main_x(target_hidden[:, T - keep:])
        block = self.block_tokens(last_token)
        X, pre = initial_streams(embed, block, cfg.hc_mult)
        for stage in self.mtp:
            X, pre = stage.run(X, pre, main_x, main_positions, block_positions)
        last = self.mtp[-1]
        h = collapse(X, pre)
        logits = nn.functional.linear(last.norm(h).float(), head.weight.float())
        tokens = block.new_empty(B, K)
        embeds = []
        previous = last_token
        for i in range(K):
            bias, e = last.markov_head(previous)
            logits[:, i] += bias
            embeds.append(e)
            if forced is not None:
                tokens[:, i] = forced[:, i]
            elif temperature == 0:
                tokens[:, i] = logits[:, i].argmax(-1)
            else:
                probs = torch.softmax(logits[:, i] / temperature, -1)
                tokens[:, i] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            previous = tokens[:, i].clone()  # a copy: the next draft is written into `tokens`, which autograd saved
        confidence = last.confidence_head(h, torch.stack(embeds, 1))
        return DraftOutput(tokens, logits, confidence, block)
