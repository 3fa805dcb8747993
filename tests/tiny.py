"""Helpers the tests import: the project root, and a tiny-width config that keeps every layer role."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ced.formats import checkpoint as checkpoint_module
from ced.formats.checkpoint import CheckpointFiles
from ced.model.config import CEDConfig, get_preset
from ced.model.network import CEDNetwork, init_weights

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


class TensorReads:
    """Records which tensors a loader reads from the shards (every read goes through `CheckpointFiles.get`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        original = CheckpointFiles.get

        def get(files: CheckpointFiles, name: str) -> torch.Tensor:
            self.names.append(name)
            return original(files, name)

        monkeypatch.setattr(checkpoint_module.CheckpointFiles, "get", get)
