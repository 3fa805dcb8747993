"""Shared fixtures: a tiny-width config that keeps every layer role, and a fresh random seed per test."""

from __future__ import annotations

import random

import pytest
import torch

from build_engines.config import CEDConfig, get_preset
from build_engines.network import CEDNetwork, init_weights


def tiny_config(**overrides: object) -> CEDConfig:
    """The small preset's 8-layer role layout at a width where a 500-token forward takes well under a second."""
    fields = dict(vocab_size=512, dim=64, q_lora_rank=32, o_lora_rank=32, moe_inter_dim=32, index_head_dim=32)
    fields.update(overrides)
    return get_preset("mol2-small", **fields)


def tiny_network(cfg: CEDConfig | None = None) -> CEDNetwork:
    net = CEDNetwork(cfg or tiny_config())
    init_weights(net)
    return net.eval()


@pytest.fixture
def seed() -> int:
    """A fresh seed each run (printed on failure by pytest's captured output), so tests see new random inputs."""
    value = random.SystemRandom().randrange(2**31)
    print(f"random seed: {value}")
    torch.manual_seed(value)
    return value


@pytest.fixture
def net(seed: int) -> CEDNetwork:
    return tiny_network()
