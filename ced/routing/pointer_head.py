"""MoL2: a pointer head that picks an adapter from H19 and option descriptions seen only through the embedding.

The query side is H19 (the last encoder layer's streams, which the normal prefill computes anyway) pooled over the
current user turn: no extra prefill, no state written. The option side (route prompt + description of each
adapter) goes through the frozen token embedding only, then a deeper MLP and self-attention within each option;
it depends only on the adapter set, so it is computed once and cached. One cross-attention layer lets the query
read the options' tokens, and a scaled q.k product scores each option (a pointer over a variable set).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from plugins.pointer_score import pointer_score

ROUTE_PROMPT = "Route this request to the assistant whose description fits best:"
HEAD_FILE, HEAD_CONFIG = "router.safetensors", "router_config.json"


@dataclass(frozen=True)
class RouterConfig:
    model_dim: int  # width of H19 and of the token embedding
    width: int  # the head's own width (scales with the model: ~15M parameters at V4.1 width)
    heads: int = 4
    option_layers: int = 1  # self-attention blocks within each option

    @staticmethod
    def for_model(model_dim: int) -> "RouterConfig":
        return RouterConfig(model_dim=model_dim, width=max(64, model_dim // 2), heads=4)


class _OptionBlock(nn.Module):
    """Pre-norm self-attention + MLP over one option's tokens (padding masked)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


@dataclass
class OptionCache:
    """The option side for one option set: everything a request needs that does not depend on the request.

    `tokens` (n, T, w), `padding` (n, T) and `keys` (n, w) are the option states, their padding and the pointer
    keys. Every linear map that follows the cross-attention's query is folded into them once (heads H, L = n*T):

    - `attn_query` (w, H*L) and `attn_bias` (H*L,): per-head query projection times the projected keys, scaled,
      so the attention scores are `cross_norm(x) @ attn_query + attn_bias` (-inf on padding);
    - `point_query` (w, n), `point_read` (H*L, n) and `point_bias` (n,): the pointer `wq(x + out_proj(read)) . keys`
      distributed over its terms, with each head's values already carried through `out_proj` and the pointer.

    A request then costs two LayerNorms, one small projection, one (H, L) softmax and two products, whatever the
    option side's depth; the fold is exact algebra (float rounding aside) and stays differentiable for training.
    """

    tokens: torch.Tensor
    padding: torch.Tensor
    keys: torch.Tensor
    attn_query: torch.Tensor
    attn_bias: torch.Tensor
    point_query: torch.Tensor
    point_read: torch.Tensor
    point_bias: torch.Tensor


class PointerHead(nn.Module):
    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.query_norm = nn.LayerNorm(cfg.model_dim)
        self.query_proj = nn.Linear(cfg.model_dim, w)
        self.option_in = nn.Sequential(nn.LayerNorm(cfg.model_dim), nn.Linear(cfg.model_dim, w), nn.GELU(),
                                       nn.Linear(w, w))
        self.option_blocks = nn.ModuleList(_OptionBlock(w, cfg.heads) for _ in range(cfg.option_layers))
        self.cross_norm = nn.LayerNorm(w)
        self.cross = nn.MultiheadAttention(w, cfg.heads, batch_first=True)
        self.wq = nn.Linear(w, w)
        self.wk = nn.Linear(w, w)

    # ------------------------------------------------------------------ option side (cached)
    def encode_options(self, option_embeddings: Sequence[torch.Tensor]) -> OptionCache:
        """Embedded options (each (T_i, model_dim), token embedding only) -> cached option states."""
        if not option_embeddings:
            raise ValueError("an option set needs at least one option")
        T = max(e.shape[0] for e in option_embeddings)
        dim = self.cfg.model_dim
        x = torch.zeros(len(option_embeddings), T, dim, device=option_embeddings[0].device)
        pad = torch.ones(len(option_embeddings), T, dtype=torch.bool, device=x.device)
        for i, e in enumerate(option_embeddings):
            x[i, : e.shape[0]] = e
            pad[i, : e.shape[0]] = False
        h = self.option_in(x)
        for block in self.option_blocks:
            h = block(h, pad)
        keep = (~pad).unsqueeze(-1).float()
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1)
        return self._fold(h, pad, self.wk(pooled))

    def _fold(self, h: torch.Tensor, pad: torch.Tensor, keys: torch.Tensor) -> OptionCache:
        """Fold the cross-attention projections and the pointer into per-option-set tensors (see OptionCache)."""
        n, T, w = h.shape
        heads, dh = self.cfg.heads, self.cfg.width // self.cfg.heads
        wq, wk, wv = self.cross.in_proj_weight.split(w)
        bq, bk, bv = self.cross.in_proj_bias.split(w)
        flat = h.reshape(n * T, w)
        k = F.linear(flat, wk, bk).reshape(n * T, heads, dh).transpose(0, 1)  # (H, L, dh)
        v = F.linear(flat, wv, bv).reshape(n * T, heads, dh).transpose(0, 1)
        scale = dh ** -0.5
        attn_query = torch.einsum("hdw,hld->whl", wq.reshape(heads, dh, w), k).reshape(w, heads * n * T) * scale
        pad_bias = torch.zeros(n * T, device=h.device).masked_fill(pad.reshape(-1), float("-inf"))
        attn_bias = ((k @ bq.reshape(heads, dh, 1)).squeeze(-1) * scale + pad_bias).reshape(heads * n * T)
        pointer = self.wq.weight.t() @ keys.t() / w ** 0.5  # (w, n): x -> logits through wq and the keys
        out_w = self.cross.out_proj.weight.t().reshape(heads, dh, w)  # rows of out_proj's input, per head
        point_read = (v @ (out_w @ pointer)).reshape(heads * n * T, n)
        point_bias = self.wq.bias @ keys.t() / w ** 0.5 + self.cross.out_proj.bias @ pointer
        return OptionCache(h, pad, keys, attn_query, attn_bias, pointer, point_read, point_bias)

    # ------------------------------------------------------------------ query side (per request)
    def score(self, h19_pooled: torch.Tensor, options: OptionCache,
              option_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, model_dim) pooled H19 -> (B, n) pointer logits over the cached options (the `mol2` PointerScore op).

        The cross-attention (`self.cross`'s parameters) and the pointer run against the option side folded in
        `OptionCache`, so a request pays only for its own query. `option_mask` (B, n) restricts each
        row to its own candidate subset (cross-attention and scores alike), so requests with different candidate
        sets share one cached option side.
        """
        x = self.query_proj(self.query_norm(h19_pooled))  # (B, w)
        if option_mask is None:
            option_mask = torch.ones(x.shape[0], options.padding.shape[0], dtype=torch.bool, device=x.device)
        return pointer_score(x, self.cross_norm(x), options.attn_query, options.attn_bias, options.point_query,
                             options.point_read, options.point_bias, option_mask, self.cfg.heads)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(directory / HEAD_FILE))
        (directory / HEAD_CONFIG).write_text(json.dumps(self.cfg.__dict__, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "PointerHead":
        directory = Path(directory)
        head = cls(RouterConfig(**json.loads((directory / HEAD_CONFIG).read_text())))
        head.load_state_dict(load_file(str(directory / HEAD_FILE)))
        return head.eval()


ROUTER_DIR = "router"


def load_router_head(model_dir: str | Path, model_dim: int) -> tuple[PointerHead, bool]:
    """The model's trained head (`<model_dir>/router`) and True, or, until one is trained, seeded random weights
    (routing arbitrary but deterministic, the same in every process) and False."""
    directory = Path(model_dir) / ROUTER_DIR
    if (directory / HEAD_CONFIG).exists():
        return PointerHead.load(directory), True
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    head = PointerHead(RouterConfig.for_model(model_dim)).eval()
    torch.random.set_rng_state(generator_state)
    return head, False


def pool_h19(encoder_out: torch.Tensor, turn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, S, hc, dim) H19 streams -> (B, dim): mean over the hc streams, then over the user-turn positions."""
    h = encoder_out.float().mean(2)
    if turn_mask is None:
        return h.mean(1)
    m = turn_mask.float().unsqueeze(-1)
    return (h * m).sum(1) / m.sum(1).clamp(min=1)


def option_text(description: str) -> str:
    """What the option side reads: the route prompt followed by the adapter's description."""
    return f"{ROUTE_PROMPT} {description}"

