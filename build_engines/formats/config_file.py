"""A checkpoint directory's `config.json`, read without the network code.

Serving processes that run compiled engines need the model's configuration (shapes, layer roles) but none of
PyTorch; `checkpoint.py` imports torch for the weights, so the config reader lives here and `checkpoint.py` reuses it.
"""

from __future__ import annotations

from pathlib import Path

from build_engines.model.config import CEDConfig

CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the network; the message names the tensor or key."""


def load_config(directory: str | Path) -> CEDConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{path} not found: a checkpoint directory needs its {CONFIG_FILE}")
    return CEDConfig.load(path)
