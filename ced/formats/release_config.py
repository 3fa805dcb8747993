"""The release's own `config.json` (DeepSeek's `inference/config.json` keys), translated into a `CEDConfig`.

Why a translation table and not a second config class: every part of the pipeline (network, engine split, memory
planner, serving) reads one `CEDConfig`, so the release enters through the same door as our own checkpoints. Each
official key is either mapped onto a field (`RENAMED`, `SAME`), checked against the one value we implement
(`FIXED`), kept as a description of a part we do not run (`NOT_RUN`: the DSpark drafter, the vision tower), or
refused. An unknown key is refused with its name, so a later release that adds a mechanism cannot be served as if
it were this one. No torch import: serving processes read configs without the network code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ced.model.config import CEDConfig, ConfigError

# official key -> CEDConfig field of the same meaning under the same name
SAME = (
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts", "n_shared_experts",
    "n_activated_experts", "route_scale", "swiglu_limit", "q_lora_rank", "head_dim", "rope_head_dim", "norm_eps",
    "o_groups", "o_lora_rank", "window_size", "kv_source_layers", "index_source_layers", "rope_theta",
    "compress_rope_theta", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer",
    "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_vocab_size",
    "engram_num_embeddings", "engram_pad_id", "engram_compressed_vocab_size", "engram_n_heads", "engram_head_dim",
)
# official key -> CEDConfig field
RENAMED = {
    "original_seq_len": "yarn_original_seq_len",
    "rope_factor": "yarn_factor",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
    "engram_layer_ids": "engram_layers",
    "engram_max_ngram_size": "engram_max_ngram",
}
# keys whose value is the only one the network implements
FIXED: dict[str, Any] = {"score_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True}
# described parts the backbone roles load nothing of (DSpark: `model/dspark.py` builds its drafter from these keys)
NOT_RUN = (
    "n_mtp_layers", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_n_activated_experts", "vision_n_layers", "vision_dim", "vision_n_heads",
    "vision_inter_dim", "vision_patch_size", "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels",
    "vision_max_wh_ratio", "image_token_id", "vision_rope_theta",
)
STORAGE_KEYS = ("dtype", "expert_dtype", "compress_ratios")
# keys that mark a file as the release's format (ours always has `name` and `n_encoder_layers`)
MARKERS = ("original_seq_len", "rope_factor", "engram_layer_ids", "n_mtp_layers", "dtype", "expert_dtype")


@dataclass(frozen=True)
class ReleaseExtras:
    """What the release's config describes beyond the backbone, kept so later stages (DSpark, vision) can read it."""

    dtype: str
    expert_dtype: str | None
    not_run: dict[str, Any] = field(default_factory=dict)

    @property
    def n_mtp_layers(self) -> int:
        return int(self.not_run.get("n_mtp_layers", 0) or 0)

    @property
    def vision(self) -> bool:
        return int(self.not_run.get("vision_n_layers", 0) or 0) > 0


def is_release_config(data: dict[str, Any]) -> bool:
    """Ours names itself (`name`) and states the encoder split; the release states neither and uses its own keys."""
    return "name" not in data and any(k in data for k in MARKERS)


def translate(data: dict[str, Any], name: str) -> tuple[CEDConfig, ReleaseExtras]:
    """Official keys -> (CEDConfig, extras). Every problem in one ConfigError, each naming its key."""
    problems: list[str] = []
    known = set(SAME) | set(RENAMED) | set(FIXED) | set(NOT_RUN) | set(STORAGE_KEYS)
    unknown = sorted(set(data) - known)
    if unknown:
        problems.append(f"unknown release config keys {unknown} (this implementation does not know what they change)")
    fields: dict[str, Any] = {k: data[k] for k in SAME if k in data}
    fields.update({ours: data[theirs] for theirs, ours in RENAMED.items() if theirs in data})
    for key, value in FIXED.items():
        if key in data and data[key] != value:
            problems.append(f"{key}={data[key]!r} is not supported (only {value!r})")
    dtype, expert_dtype = data.get("dtype", "bf16"), data.get("expert_dtype")
    if dtype not in ("fp8", "bf16"):
        problems.append(f"dtype={dtype!r} is not supported ('fp8' or 'bf16')")
    if expert_dtype not in (None, "fp4"):
        problems.append(f"expert_dtype={expert_dtype!r} is not supported (None or 'fp4')")
    if dtype == "bf16":
        problems.append("dtype='bf16' is not supported: the release's arithmetic quantizes the KV caches at run time "
                        "while keeping activations unquantized, which our runtime_fake_quant switch does not separate")
    n_layers, n_mtp = data.get("n_layers"), int(data.get("n_mtp_layers", 0) or 0)
    ratios = data.get("compress_ratios")
    if not isinstance(ratios, list) or not isinstance(n_layers, int):
        problems.append("compress_ratios (a list) and n_layers (an int) are required")
    else:
        if len(ratios) != n_layers + n_mtp:
            problems.append(f"compress_ratios has {len(ratios)} entries, n_layers + n_mtp_layers is {n_layers + n_mtp}")
        if any(r != 0 for r in ratios[n_layers:]):
            problems.append(f"draft-layer compress ratios {ratios[n_layers:]} must be 0 "
                            "(DSpark blocks are sliding-window only)")
        fields["compress_ratios"] = tuple(ratios[:n_layers])
    if "candidate_source_layer" not in data:
        problems.append("candidate_source_layer is required: it is the first decoder layer, where the encoder ends")
    else:
        fields["n_encoder_layers"] = data["candidate_source_layer"]
    if problems:
        raise ConfigError(f"release config {name!r}: " + "; ".join(problems))
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    fields["runtime_fake_quant"] = dtype == "fp8"
    fields.setdefault("yarn_original_seq_len", 0)
    cfg = CEDConfig(name=name, **fields)
    return cfg, ReleaseExtras(dtype, expert_dtype, {k: data[k] for k in NOT_RUN if k in data})


def to_release_dict(cfg: CEDConfig, extras: ReleaseExtras) -> dict[str, Any]:
    """The inverse: our config written with the official keys (what the release-shaped checkpoint writer emits)."""
    out: dict[str, Any] = {}
    for key in SAME:
        out[key] = getattr(cfg, key)
    for theirs, ours in RENAMED.items():
        out[theirs] = getattr(cfg, ours)
    out.update(FIXED)
    out["dtype"], out["expert_dtype"] = extras.dtype, extras.expert_dtype
    out["compress_ratios"] = list(cfg.compress_ratios) + [0] * extras.n_mtp_layers
    out.update(extras.not_run)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
