"""Parallel layouts on paper: weights per GPU, memory left for sessions, sessions at 32K / 128K context and collective
bytes per decode step, per serving role (encoder: layers 0..E-1, the embedding and layer E's attention; decoder: layer
E's FFN, layers E+1..L-1, the head), for tensor-parallel, expert-parallel and mixed layouts.

Run `python -m build_engines.verify.parallel_plan --preset deepseek-v4.1-flash --gpus 8`. Arithmetic from the preset's
shapes and the release's storage formats (`plan.py`), nothing measured. What each layout splits:

* attention tensor parallel (`attn_tp`): query heads (`wq_b`, `attn_sink`), the grouped output projection (`wo_a`, by
  group) and `wo_b` (by its input), the indexer's query heads (`indexer.wq_b`, `indexer.weights_proj`), and the
  vocabulary (embedding and head rows), as `ced/parallel` splits them. V4.1's attention reads ONE shared KV
  latent per layer (`wkv`, 512 wide), so the KV projection, the compressor, the indexer keys and therefore every
  session's global KV and window rings are replicated on each rank of an attention group. The GPUs not in one group
  serve other sessions (attention data parallel, `attn_dp = gpus / attn_tp`): each session's KV lives in one group.
* experts: routed experts spread over `expert_ep` ranks (whole experts), each sliced along its intermediate width
  over `expert_tp` ranks (`expert_ep * expert_tp = gpus`); the shared expert is sliced over `expert_tp`.
* replicated everywhere: mHC mixing, norms, the gate, `wq_a`, the KV projection, compressor and indexer keys.

Collectives per token and layer, bf16 activations of `dim`: attention tensor parallel ends each attention with an
all-reduce over its group, and each indexed layer all-reduces its per-head scores over the layer's T / ratio store
entries (fp32: it grows with the context T); sliced experts end the FFN with an all-reduce over `expert_tp`; expert
parallel sends each token to the ranks of its top-k experts and back (all-to-all dispatch and combine; a token's experts
on its own rank move nothing). Bytes are what one GPU sends per token: a ring all-reduce of n ranks sends 2 (n - 1) / n
of the vector; an all-to-all sends each of the top-k copies that lands on another rank, (ep - 1) / ep of them on
average.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
from dataclasses import dataclass

from ced.model.config import CEDConfig, get_preset
from ced.plan import MemoryPlan, _stored_bytes, plan, state_shapes

HBM_BYTES = 141e9  # an H200
RESERVE = 0.10  # kept for activations, workspaces, the runtime
ACT_BYTES = 2  # bf16 activations on the wire


@dataclass(frozen=True)
class Layout:
    name: str
    attn_tp: int
    expert_ep: int
    expert_tp: int

    def check(self, cfg: CEDConfig, gpus: int) -> None:
        if self.expert_ep * self.expert_tp != gpus or gpus % self.attn_tp:
            raise ValueError(f"{self.name}: expert_ep x expert_tp must be {gpus} and attn_tp must divide it")
        for what, n, by in (("query heads", cfg.n_heads, self.attn_tp), ("output groups", cfg.o_groups, self.attn_tp),
                            ("routed experts", cfg.n_routed_experts, self.expert_ep),
                            ("expert width", cfg.moe_inter_dim, self.expert_tp)):
            if n % by:
                raise ValueError(f"{self.name}: {what} ({n}) do not split over {by} ranks")


LAYOUTS = (Layout("TP8", 8, 1, 8), Layout("EP8 (attention DP8)", 1, 8, 1), Layout("TP2 x EP4", 2, 4, 2),
           Layout("TP8 attention, EP8 experts", 8, 8, 1))


def role_of(name: str, first_decoder: int) -> str:
    """'encoder' or 'decoder': which serving role holds this tensor (layer E's attention sits in the encoder)."""
    if name.startswith("embed."):
        return "encoder"
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    if m is None:
        return "decoder"  # the final norm and the head
    layer, rest = int(m.group(1)), m.group(2)
    if layer < first_decoder:
        return "encoder"
    if layer > first_decoder:
        return "decoder"
    return "decoder" if rest.startswith(("ffn", "hc_ffn")) else "encoder"


def share(name: str, layout: Layout) -> float:
    """The fraction of this tensor one GPU holds."""
    if name in ("embed.weight", "head.weight") or re.search(
            r"\.attn\.(wq_b|wo_a|wo_b|attn_sink|indexer\.wq_b|indexer\.weights_proj)", name):
        return 1 / layout.attn_tp
    if ".ffn.experts." in name:
        return 1 / (layout.expert_ep * layout.expert_tp)
    if ".ffn.shared_experts." in name:
        return 1 / layout.expert_tp
    return 1.0


@dataclass
class RolePlan:
    role: str
    layout: Layout
    weights_per_gpu: float
    free_per_gpu: float
    session_fixed: float  # bytes per session whatever its length (rings, the decoder's recent rows)
    kv_per_token: float
    collective_bytes_per_token: float  # at no context: the fixed part
    index_score_bytes_per_context_token: float  # plus this times the context length

    def collective_bytes(self, context: int) -> float:
        """What one GPU sends per decode token at `context` tokens of context."""
        return self.collective_bytes_per_token + self.index_score_bytes_per_context_token * context

    def sessions(self, context: int, gpus: int) -> int:
        """Sessions the role holds at `context` tokens: each attention group holds its own sessions, replicated on
        the group's ranks, so capacity = groups x one GPU's free bytes / one session's bytes."""
        groups = gpus // self.layout.attn_tp
        return int(groups * self.free_per_gpu // (self.session_fixed + self.kv_per_token * context))


@functools.lru_cache(maxsize=4)
def _model_bytes(cfg: CEDConfig) -> tuple[MemoryPlan, dict[str, int]]:
    """The memory plan and each tensor's release bytes (building the meta network takes ~10 s at the release's size)."""
    shapes = state_shapes(cfg)
    return plan(cfg, shapes), {k: sum(_stored_bytes(k, s).values()) for k, s in shapes.items()}


def role_plans(cfg: CEDConfig, gpus: int, layouts: tuple[Layout, ...] = LAYOUTS) -> list[RolePlan]:
    memory, stored = _model_bytes(cfg)
    E, L = cfg.first_decoder_layer, cfg.n_layers
    ring = memory.swa_ring_bytes_per_session / L  # per layer, fp8 + scales
    handover_row = (cfg.hc_mult * cfg.dim * 2 + cfg.hc_mult * 4 + cfg.index_topk * 4 + cfg.candidate_topk_blocks * 4
                    + cfg.head_dim * 2 + cfg.index_head_dim * 2)  # bf16 streams, int32 indices
    fixed = {"encoder": ring * (E + 1), "decoder": ring * (L - E - 1) + cfg.window_size * handover_row}
    # (attention sub-layers, FFN sub-layers) per role
    sublayers = {"encoder": (E + 1, E), "decoder": (L - E - 1, L - E)}
    indexed = {"encoder": [], "decoder": []}  # the index layers' store ratios, by role (layer E's attention: encoder)
    for name in stored:
        m = re.match(r"layers\.(\d+)\.attn\.indexer\.wq_b\.", name)
        if m:
            layer = int(m.group(1))
            indexed["encoder" if layer <= E else "decoder"].append(cfg.compress_ratios[layer])
    out = []
    for layout in layouts:
        layout.check(cfg, gpus)
        for role in ("encoder", "decoder"):
            weights = sum(b * share(k, layout) for k, b in stored.items() if role_of(k, E) == role)
            attn, ffn = sublayers[role]
            vector = cfg.dim * ACT_BYTES
            per_token = attn * _all_reduce(vector, layout.attn_tp) + ffn * _all_reduce(vector, layout.expert_tp)
            per_token += ffn * 2 * cfg.n_activated_experts * vector * (layout.expert_ep - 1) / layout.expert_ep
            scores = sum(_all_reduce(4 / ratio, layout.attn_tp) for ratio in indexed[role])  # fp32 per context token
            out.append(RolePlan(role, layout, weights, HBM_BYTES * (1 - RESERVE) - weights, fixed[role],
                                memory.global_kv_bytes_per_token, per_token, scores))
    return out


def _all_reduce(nbytes: float, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks * nbytes if ranks > 1 else 0.0


def plan_markdown(cfg: CEDConfig, gpus: int) -> str:
    rows = ["| layout | role | weights per GPU | free per GPU | sessions at 32K | sessions at 128K "
            "| collective KB per decode token per GPU, 32K / 128K context |", "|---|---|---|---|---|---|---|"]
    for p in role_plans(cfg, gpus):
        rows.append(f"| {p.layout.name} | {p.role} | {p.weights_per_gpu / 1e9:.1f} GB | "
                    f"{p.free_per_gpu / 1e9:.1f} GB | "
                    f"{p.sessions(32768, gpus):,} | {p.sessions(131072, gpus):,} | "
                    f"{p.collective_bytes(32768) / 1e3:.0f} / {p.collective_bytes(131072) / 1e3:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v4.1-flash")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per role")
    args = parser.parse_args(argv)
    cfg = get_preset(args.preset)
    print(f"{args.preset}, {args.gpus} x H200 ({HBM_BYTES / 1e9:.0f} GB, {RESERVE:.0%} kept) per role\n")
    print(plan_markdown(cfg, args.gpus))
    print(f"\nsession bytes: global KV {_model_bytes(cfg)[0].global_kv_bytes_per_token:.0f} B per token; "
          f"{math.ceil(cfg.window_size)}-row rings and recent rows as fixed bytes per session")


if __name__ == "__main__":
    main()
