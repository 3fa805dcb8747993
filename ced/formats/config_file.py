"""A checkpoint directory's `config.json`, read without the network code.

Serving processes that run compiled engines need the model's configuration (shapes, layer roles) but none of
PyTorch; `checkpoint.py` imports torch for the weights, so the config reader lives here and `checkpoint.py` reuses it.
Two formats enter here: ours (`CEDConfig.save`, it names itself) and the release's (DeepSeek's `inference/config.json`
keys, translated by `release_config`). A Hugging Face style root `config.json` (`model_type`, `architectures`) is
read through the `inference/config.json` the release ships beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ced.formats.release_config import ReleaseExtras, is_release_config, translate
from ced.model.config import CEDConfig, ConfigError

CONFIG_FILE = "config.json"
RELEASE_INFERENCE_CONFIG = Path("inference") / CONFIG_FILE


class CheckpointError(ValueError):
    """A checkpoint that does not fit the network; the message names the tensor or key."""


class CheckpointConfigError(CheckpointError, ConfigError):
    """A config file the network cannot run: both kinds, so callers catching either see it."""


def config_path(directory: str | Path) -> Path:
    """The file that describes the network: `config.json`, or the release's `inference/config.json` beside a HF one."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{path} not found: a checkpoint directory needs its {CONFIG_FILE}")
    data = _read(path)
    if "model_type" in data or "architectures" in data:
        inference = directory / RELEASE_INFERENCE_CONFIG
        if not inference.exists():
            raise CheckpointError(f"{path} is a Hugging Face config "
                                  f"({data.get('model_type', data.get('architectures'))}); "
                                  f"the network is described by the release's {RELEASE_INFERENCE_CONFIG}, "
                                  "which is missing")
        return inference
    return path


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def load_config_and_extras(directory: str | Path) -> tuple[CEDConfig, ReleaseExtras | None]:
    """The config and, for a release directory, what it describes beyond the backbone (DSpark, vision, storage)."""
    path = config_path(directory)
    data = _read(path)
    try:
        if is_release_config(data):
            return translate(data, name=Path(directory).resolve().name)
        return CEDConfig.from_dict(data), None
    except ConfigError as exc:
        raise CheckpointConfigError(f"{path}: {exc}") from exc


def load_config(directory: str | Path) -> CEDConfig:
    return load_config_and_extras(directory)[0]
