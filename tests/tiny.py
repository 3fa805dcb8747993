"""Helpers the tests import: the project root, and a tiny-width config that keeps every layer role."""

from __future__ import annotations

from pathlib import Path

from build_engines.model.config import CEDConfig, get_preset
from build_engines.model.network import CEDNetwork, init_weights

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def tiny_config(**overrides: object) -> CEDConfig:
    """The small preset's 8-layer role layout at a width where a 500-token forward takes well under a second."""
    fields = dict(vocab_size=512, dim=64, q_lora_rank=32, o_lora_rank=32, moe_inter_dim=32, index_head_dim=32)
    fields.update(overrides)
    return get_preset("mol2-small", **fields)


def tiny_network(cfg: CEDConfig | None = None) -> CEDNetwork:
    net = CEDNetwork(cfg or tiny_config())
    init_weights(net)
    return net.eval()
