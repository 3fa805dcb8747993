"""`StepEngine`: what every engine implementation offers (the selector is `select.open_engine`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ced.formats.config_file import load_config
from ced.steps.layout import StepLayout

if TYPE_CHECKING:
    from ced.steps.engram_feed import EngramFeed

BACKENDS = ("torch", "onnx", "trt")
Arrays = dict[str, np.ndarray]


class EngineUnavailable(RuntimeError):
    """The engine cannot be opened here (not built, stale, or its runtime is missing); the message says what to do."""


class StepEngine(ABC):
    """One model's encoder, decoder and pointer steps. Not thread-safe: one caller thread per engine."""

    backend: str

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.cfg = load_config(model_dir)
        self.layout = StepLayout(self.cfg)
        self.lora_bank: Arrays = {}
        self._engram: EngramFeed | None = None

    @property
    def engram(self) -> "EngramFeed | None":
        """The checkpoint's Engram feed (hashes + rows gathered from its memory-mapped tables), opened on first use, so
        that only a process that encodes pays for it (`EncoderService` asks at start-up); None without Engram."""
        if self._engram is None and self.layout.engram_layers:
            # imported here: the feed hashes and dequantizes with torch, which an Engram-free onnx/trt stub never loads
            from ced.steps.engram_feed import EngramFeed

            self._engram = EngramFeed.open(self.model_dir, self.layout)
        return self._engram

    @abstractmethod
    def encoder(self, feed: Arrays) -> Arrays:
        """One encoder step (inputs/outputs as `StepLayout.encoder_inputs/outputs`)."""

    @abstractmethod
    def decoder(self, feed: Arrays) -> Arrays:
        """One decoder step; the LoRA bank set by `set_lora_bank` is added to `feed`."""

    @abstractmethod
    def pointer(self, feed: Arrays) -> Arrays:
        """MoL2 pointer scores of a batch of pooled H19 rows against the option cache."""

    @property
    def has_drafter(self) -> bool:
        """Whether these engines hold a DSpark drafter (the decoder then returns `draft_main`)."""
        return self.layout.drafter is not None

    def drafter(self, feed: Arrays) -> Arrays:
        """DSpark's block of greedy drafts (inputs/outputs as `StepLayout.drafter_inputs/outputs`)."""
        raise EngineUnavailable(f"the {self.backend} engines of {self.model_dir} hold no DSpark drafter")

    def set_lora_bank(self, bank: Arrays) -> None:
        """The stacked adapter bank (`ced.steps.lora_stacked`); called when the adapter set changes."""
        self.lora_bank = bank

    def describe(self) -> str:
        return self.backend


def check_engine_dir(engine_dir: Path, model_dir: Path, fmt: str) -> dict:
    """The manifest of a current engine directory, or EngineUnavailable naming the build command."""
    from ced.engine_dir.manifest import BuildSettings, read_manifest, stale_reason
    from ced.steps.opset import OPSET

    manifest = read_manifest(engine_dir)
    settings = (manifest or {}).get("settings", {})
    quant, kv_quant = settings.get("quant", "none"), settings.get("kv_quant", "none")
    reason = stale_reason(engine_dir, model_dir, BuildSettings(fmt, quant, OPSET, kv_quant))
    if reason is not None:
        command = f"python -m build_engines build --model {model_dir} --out {engine_dir} --format {fmt}"
        command += f" --quant {quant}" if quant != "none" else ""
        command += f" --kv-quant {kv_quant}" if kv_quant != "none" else ""
        raise EngineUnavailable(f"the {fmt} engines in {engine_dir} cannot be used ({reason}); build them with "
                                f"`{command}`")
    assert manifest is not None
    return manifest
