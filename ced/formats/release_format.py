"""The released DeepSeek-V4.1-Flash checkpoint format, written down as data.

Two tables: which storage format each parameter has in the release (fp8 blocks, packed fp4 experts, bf16, f32),
and the published tensor names and shapes of the real model (transcribed from the release's documented tensor
list). The loader and the synthetic-checkpoint writer read the first; a test checks the `deepseek-v4.1-flash`
preset against the second, which is deliberately independent of `CEDConfig` so that a config mistake shows up.
"""

from __future__ import annotations

import re
from enum import Enum


class Storage(Enum):
    FP8_BLOCKS = "fp8 e4m3, ue8m0 scale per 32x32 block"
    FP4_PACKED = "fp4 e2m1 packed 2 per byte, ue8m0 scale per 32 along K"
    FP8_ROWS = "fp8 e4m3, ue8m0 scale per 32 along each row (Engram tables)"
    BF16 = "bf16"
    F32 = "f32"


# (regex on the parameter name, storage). First match wins.
# `mtp.N.` (the DSpark blocks) store like backbone layers.
STORAGE_RULES: list[tuple[re.Pattern[str], Storage]] = [
    (re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$"), Storage.FP4_PACKED),
    (re.compile(r"^(layers|mtp)\.\d+\.ffn\.shared_experts\.w[123]\.weight$"), Storage.FP8_BLOCKS),
    (re.compile(r"^(layers|mtp)\.\d+\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$"), Storage.FP8_BLOCKS),
    (re.compile(r"^layers\.\d+\.engram\.embed\.weight$"), Storage.FP8_ROWS),
    (re.compile(r"^(layers\.\d+\.engram\.wkv|mtp\.0\.main_proj)\.weight$"), Storage.FP8_BLOCKS),
    (re.compile(r"^(layers|mtp)\.\d+\.(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias(_vl)?)$"),
     Storage.F32),
    (re.compile(r".*"), Storage.BF16),
]

# Tensors of optional extras this implementation does not run; the loader reports and skips them.
OPTIONAL_EXTRA_PREFIXES: tuple[str, ...] = ("mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")
OPTIONAL_EXTRA_PATTERN = re.compile(r"^layers\.\d+\.engram\.")


def storage_of(name: str) -> Storage:
    for pattern, storage in STORAGE_RULES:
        if pattern.match(name):
            return storage
    raise AssertionError("the last rule matches everything")


def is_optional_extra(name: str) -> bool:
    return name.startswith(OPTIONAL_EXTRA_PREFIXES) or bool(OPTIONAL_EXTRA_PATTERN.match(name))


# ----------------------------------------------------------------------------------------------------------
# Published tensor list of DeepSeek-V4.1-Flash (logical shapes; packed fp4 experts store half the last dim).
PUBLISHED_KV_SOURCES = (2, 8, 14, 20)
PUBLISHED_RATIO2_SOURCES = (2, 8, 14)
PUBLISHED_INDEX_LAYERS = (2, 8, 14, 20, 24, 28, 32, 36)
PUBLISHED_N_LAYERS = 40
PUBLISHED_N_EXPERTS = 384

_GLOBAL = {
    "embed.weight": (129280, 5120),
    "head.weight": (129280, 5120),
    "norm.weight": (5120,),
}
_EVERY_LAYER = {
    "attn_norm.weight": (5120,),
    "ffn_norm.weight": (5120,),
    "hc_attn_fn": (24, 20480),
    "hc_attn_base": (24,),
    "hc_attn_scale": (3,),
    "hc_ffn_fn": (24, 20480),
    "hc_ffn_base": (24,),
    "hc_ffn_scale": (3,),
    "attn.wq_a.weight": (1280, 5120),
    "attn.q_norm.weight": (1280,),
    "attn.wq_b.weight": (32768, 1280),
    "attn.wkv.weight": (512, 5120),
    "attn.kv_norm.weight": (512,),
    "attn.wo_a.weight": (8192, 4096),
    "attn.wo_b.weight": (5120, 8192),
    "attn.attn_sink": (64,),
    "ffn.gate.weight": (384, 5120),
    "ffn.gate.bias": (384,),
    "ffn.gate.bias_vl": (384,),
    "ffn.shared_experts.w1.weight": (2304, 5120),
    "ffn.shared_experts.w2.weight": (5120, 2304),
    "ffn.shared_experts.w3.weight": (2304, 5120),
}
_EXPERT = {"w1.weight": (2304, 5120), "w2.weight": (5120, 2304), "w3.weight": (2304, 5120)}
_KV_SOURCE = {"attn.compressor.wkv.weight": (512, 5120), "attn.compressor.norm.weight": (512,)}
_RATIO2_SOURCE = {"attn.compressor.wgate.weight": (512, 5120)}
_INDEX_LAYER = {"attn.indexer.wq_b.weight": (4096, 1280), "attn.indexer.weights_proj.weight": (32, 5120)}
_KEY_OWNER = {"attn.indexer.wk.weight": (128, 512), "attn.indexer.k_norm.weight": (128,)}


def published_flash_tensors() -> dict[str, tuple[int, ...]]:
    """Every backbone tensor of the release (Engram, DSpark `mtp.*` and vision excluded) with its logical shape."""
    out = dict(_GLOBAL)
    for n in range(PUBLISHED_N_LAYERS):
        groups = [_EVERY_LAYER]
        if n in PUBLISHED_KV_SOURCES:
            groups.append(_KV_SOURCE)
        if n in PUBLISHED_RATIO2_SOURCES:
            groups.append(_RATIO2_SOURCE)
        if n in PUBLISHED_INDEX_LAYERS:
            groups.append(_INDEX_LAYER)
        if n in PUBLISHED_KV_SOURCES and n in PUBLISHED_INDEX_LAYERS:
            groups.append(_KEY_OWNER)
        for group in groups:
            out.update({f"layers.{n}.{k}": v for k, v in group.items()})
        for e in range(PUBLISHED_N_EXPERTS):
            out.update({f"layers.{n}.ffn.experts.{e}.{k}": v for k, v in _EXPERT.items()})
    return out


# Published sizes the memory planner compares against.
PUBLISHED_BACKBONE_PARAMS = 552e9  # report: 552B backbone (+196B Engram)
PUBLISHED_GLOBAL_KV_BYTES_PER_TOKEN = 890  # report, recomputed in a public review
# whole checkpoint incl. Engram/DSpark/vision
PUBLISHED_DTYPE_BYTES = {"BF16": 3.95e9, "F32": 0.17e9, "F8_E4M3": 204e9, "F8_E8M0": 23.6e9, "I8": 278.6e9}
