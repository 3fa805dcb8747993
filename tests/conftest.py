"""Shared fixtures: a fresh random seed per test, and a tiny network drawn with it."""

from __future__ import annotations

import random

import pytest
import torch

from build_engines.model.network import CEDNetwork
from tests.tiny import tiny_network


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
