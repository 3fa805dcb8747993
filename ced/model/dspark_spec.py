"""DSpark's shape as one value: the release's `n_mtp_layers` / `dspark_*` keys, checked against the backbone.

Torch-free on purpose: the engine layout (`ced.steps.layout`) carries it, and runtimes that never load
torch (an onnx router or encoder stub) read it from an engine manifest. The forward pass is `dspark.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ced.model.config import CEDConfig, ConfigError


@dataclass(frozen=True)
class DSparkSpec:
    """The release's DSpark keys (`n_mtp_layers`, `dspark_*`) as one validated value."""

    n_stages: int
    block_size: int
    noise_token_id: int
    target_layers: tuple[int, ...]
    markov_rank: int
    n_routed_experts: int
    n_activated_experts: int

    @classmethod
    def from_release(cls, cfg: CEDConfig, keys: Mapping[str, Any]) -> "DSparkSpec":
        """From `ReleaseExtras.not_run`. As the official `get_moe_config`, an expert count of 0 means the backbone's."""
        spec = cls(
            n_stages=int(keys.get("n_mtp_layers", 0) or 0),
            block_size=int(keys.get("dspark_block_size", 0) or 0),
            noise_token_id=int(keys.get("dspark_noise_token_id", 0) or 0),
            target_layers=tuple(int(l) for l in keys.get("dspark_target_layer_ids", ()) or ()),
            markov_rank=int(keys.get("dspark_markov_rank", 256)),
            n_routed_experts=int(keys.get("dspark_n_routed_experts", 0) or 0) or cfg.n_routed_experts,
            n_activated_experts=int(keys.get("dspark_n_activated_experts", 0) or 0) or cfg.n_activated_experts,
        )
        spec.check(cfg)
        return spec

    @classmethod
    def scaled(cls, cfg: CEDConfig) -> "DSparkSpec":
        """A drafter for a small preset, scaled as the release's is to its backbone: 3 stages, block 5, the last noise
        id of the vocabulary, the last three layers as targets, Markov rank dim/8 (256 at 5120 in the release is
        dim/20; small widths keep more), a third of the experts (at least top-k), half the top-k."""
        spec = cls(
            n_stages=3, block_size=5, noise_token_id=cfg.vocab_size - 1,
            target_layers=tuple(range(max(0, cfg.n_layers - 3), cfg.n_layers)),
            markov_rank=min(256, max(16, cfg.dim // 8)),
            n_routed_experts=max(cfg.n_activated_experts, cfg.n_routed_experts // 3),
            n_activated_experts=max(1, cfg.n_activated_experts // 2),
        )
        spec.check(cfg)
        return spec

    def to_release(self) -> dict[str, Any]:
        """The official keys (what `ReleaseExtras.not_run` holds for them)."""
        return {"n_mtp_layers": self.n_stages, "dspark_block_size": self.block_size,
                "dspark_noise_token_id": self.noise_token_id, "dspark_target_layer_ids": list(self.target_layers),
                "dspark_markov_rank": self.markov_rank, "dspark_n_routed_experts": self.n_routed_experts,
                "dspark_n_activated_experts": self.n_activated_experts}

    def check(self, cfg: CEDConfig) -> None:
        problems = []
        if self.n_stages < 1 or self.block_size < 1:
            problems.append(f"n_mtp_layers={self.n_stages} and dspark_block_size={self.block_size} must be positive "
                            "(the official model builds no drafter otherwise)")
        if not 0 <= self.noise_token_id < cfg.vocab_size:
            problems.append(f"dspark_noise_token_id={self.noise_token_id} is not a token id (0..{cfg.vocab_size - 1})")
        layers = list(self.target_layers)
        if not layers or layers != sorted(set(layers)) or not all(0 <= l < cfg.n_layers for l in layers):
            problems.append(f"dspark_target_layer_ids={layers} must be strictly increasing layers of "
                            f"0..{cfg.n_layers - 1}")
        if self.markov_rank < 1:
            problems.append(f"dspark_markov_rank={self.markov_rank} must be positive")
        if not 0 < self.n_activated_experts <= self.n_routed_experts:
            problems.append(f"dspark_n_activated_experts={self.n_activated_experts} must lie in "
                            f"1..dspark_n_routed_experts={self.n_routed_experts}")
        if 0 not in cfg.compress_ratios:
            problems.append("the config has no sliding-window-only layer to take the DSpark blocks' "
                            "attention role from")
        if problems:
            raise ConfigError(f"DSpark for {cfg.name!r}: " + "; ".join(problems))


def stage_config(cfg: CEDConfig, spec: DSparkSpec) -> CEDConfig:
    """The backbone config with the drafter's expert count and top-k, without Engram (a DSpark block has none)."""
    return cfg.replace(n_routed_experts=spec.n_routed_experts, n_activated_experts=spec.n_activated_experts,
                       engram_layers=(), engram_num_embeddings=())
