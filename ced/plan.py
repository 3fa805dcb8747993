"""Memory planner: weight bytes and KV bytes per token of a preset, next to the published figures.

Run `python -m ced.plan --preset deepseek-v4.1-flash`. Weights are counted on a meta-device network
(nothing is allocated), in the release's storage formats (fp8 blocks + scales, packed fp4 experts + scales, bf16,
f32) and as plain bf16; KV bytes follow V4.1's runtime formats (fp4 global KV with an E4M3 scale per 16 channels,
fp4 index keys with a ue8m0 scale per 32, fp8 window KV with a ue8m0 scale per 32).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

import torch

from ced.formats.release_format import (
    PUBLISHED_BACKBONE_PARAMS,
    PUBLISHED_GLOBAL_KV_BYTES_PER_TOKEN,
    Storage,
    storage_of,
)
from ced.model.config import PRESETS, CEDConfig, get_preset
from ced.model.network import CEDNetwork


@dataclass
class MemoryPlan:
    preset: str
    params_total: int
    params_routed_experts: int
    params_embed_head: int
    weight_bytes_release: int  # release storage formats, scales included
    weight_bytes_by_dtype: dict[str, int]
    weight_bytes_bf16: int
    global_kv_bytes_per_token: float  # runtime fp4 formats
    global_kv_main_bytes_per_token: float
    global_kv_index_bytes_per_token: float
    swa_ring_bytes_per_session: int  # all layers, fp8 + scales, fixed whatever the context length
    adapter_ring_bytes_per_session: int  # the rings of layers 21..39, the only adapter-dependent state
    active_params_per_token: int


def _stored_bytes(name: str, shape: tuple[int, ...]) -> dict[str, int]:
    """Bytes of one tensor in the release, by safetensors dtype (scales counted as F8_E8M0)."""
    numel = math.prod(shape)
    storage = storage_of(name)
    if storage is Storage.FP8_BLOCKS:
        return {"F8_E4M3": numel, "F8_E8M0": math.ceil(shape[0] / 32) * math.ceil(shape[1] / 32)}
    if storage is Storage.FP4_PACKED:
        return {"I8": numel // 2, "F8_E8M0": shape[0] * math.ceil(shape[1] / 32)}
    return {"F32": numel * 4} if storage is Storage.F32 else {"BF16": numel * 2}


def fp4_bytes(channels: int, scale_block: int) -> float:
    """Half a byte per value plus one byte of scale per block."""
    return channels / 2 + channels / scale_block


def state_shapes(cfg: CEDConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from a network on the meta device (nothing allocated; ~10 s at the release's size)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in CEDNetwork(cfg).state_dict().items()}


def plan(cfg: CEDConfig, shapes: dict[str, tuple[int, ...]] | None = None) -> MemoryPlan:
    """`shapes`: `state_shapes(cfg)` when the caller has them already."""
    shapes = state_shapes(cfg) if shapes is None else shapes
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for k, s in shapes.items() if ".ffn.experts." in k)
    embed_head = sum(math.prod(shapes[k]) for k in ("embed.weight", "head.weight"))
    main = sum(fp4_bytes(cfg.head_dim, 16) / cfg.compress_ratios[l] for l in cfg.kv_source_layers)
    index = sum(fp4_bytes(cfg.index_head_dim, 32) / cfg.compress_ratios[l] for l in cfg.kv_source_layers
                if cfg.owns_index_keys(l))
    ring_per_layer = cfg.window_size * (cfg.head_dim + cfg.head_dim // 32)
    per_expert = experts // (cfg.n_routed_experts * cfg.n_layers)
    active = (total - experts - embed_head + cfg.n_layers * cfg.n_activated_experts * per_expert
              + shapes["head.weight"][0] * cfg.dim)
    by_dtype: dict[str, int] = {}
    for k, s in shapes.items():
        for dtype, n in _stored_bytes(k, s).items():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return MemoryPlan(
        preset=cfg.name,
        params_total=total,
        params_routed_experts=experts,
        params_embed_head=embed_head,
        weight_bytes_release=sum(by_dtype.values()),
        weight_bytes_by_dtype=by_dtype,
        weight_bytes_bf16=2 * total,
        global_kv_bytes_per_token=main + index,
        global_kv_main_bytes_per_token=main,
        global_kv_index_bytes_per_token=index,
        swa_ring_bytes_per_session=cfg.n_layers * ring_per_layer,
        adapter_ring_bytes_per_session=(cfg.n_layers - cfg.first_decoder_layer - 1) * ring_per_layer,
        active_params_per_token=active,
    )


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.1f} B"


def format_plan(p: MemoryPlan, cfg: CEDConfig) -> str:
    rows = [
        ("parameters (backbone, no Engram/DSpark/vision)", _count(p.params_total)),
        ("  routed experts", _count(p.params_routed_experts)),
        ("  embedding + head", _count(p.params_embed_head)),
        ("active parameters per token", _count(p.active_params_per_token)),
        ("weight bytes, release formats (fp8/fp4 + scales)", _bytes(p.weight_bytes_release)),
        *((f"  {dtype}", _bytes(n)) for dtype, n in sorted(p.weight_bytes_by_dtype.items())),
        ("weight bytes, all bf16", _bytes(p.weight_bytes_bf16)),
        ("global KV bytes per token (fp4 + scales)", f"{p.global_kv_bytes_per_token:.1f} B"),
        ("  main compressed entries", f"{p.global_kv_main_bytes_per_token:.1f} B"),
        ("  index keys", f"{p.global_kv_index_bytes_per_token:.1f} B"),
        ("SWA rings per session (fp8 + scales, all layers)", _bytes(p.swa_ring_bytes_per_session)),
        (f"  adapter-dependent rings (layers {cfg.first_decoder_layer + 1}..{cfg.n_layers - 1})",
         _bytes(p.adapter_ring_bytes_per_session)),
        ("global KV for a 128K-token context", _bytes(p.global_kv_bytes_per_token * 131072)),
    ]
    if cfg.name == "deepseek-v4.1-flash":
        rows += [
            ("published backbone parameters",
             f"{PUBLISHED_BACKBONE_PARAMS / 1e9:.0f} B (ratio {p.params_total / PUBLISHED_BACKBONE_PARAMS:.4f})"),
            ("published global KV bytes per token",
             f"{PUBLISHED_GLOBAL_KV_BYTES_PER_TOKEN} B "
             f"(ratio {p.global_kv_bytes_per_token / PUBLISHED_GLOBAL_KV_BYTES_PER_TOKEN:.4f})"),
        ]
    width = max(len(r[0]) for r in rows)
    return "\n".join([f"memory plan for preset {p.preset!r}"] + [f"  {k.ljust(width)}  {v}" for k, v in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v4.1-flash", help=f"one of {sorted(PRESETS)}")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        cfg = get_preset(args.preset)
    except ValueError as exc:
        parser.error(str(exc))
    p = plan(cfg)
    print(json.dumps(asdict(p), indent=2) if args.json else format_plan(p, cfg))


if __name__ == "__main__":
    main()
