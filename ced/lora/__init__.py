"""LoRA adapters: identity (`identity`, `adapter`), placement rules (`placement`), PEFT files (`peft_io`), the per-row
bank (`bank`). The names below are the package's public API.

Everything but `adapter_hash` needs PyTorch and is imported on first use (PEP 562), so that a process that only names
adapters (the registry in a serving stub) never imports torch: about 1.4 s of CPU and 190 MB per process.
"""

from __future__ import annotations

import importlib
from typing import Any

from ced.lora.identity import adapter_hash as adapter_hash

_LAZY = {
    "Adapter": "adapter", "AdapterError": "adapter", "AdapterBank": "bank",
    "ADAPTER_CONFIG": "peft_io", "ADAPTER_WEIGHTS": "peft_io", "PEFT_PREFIX": "peft_io",
    "random_adapter_weights": "peft_io", "read_adapter": "peft_io", "save_adapter": "peft_io",
    "UNSUPPORTED_TARGETS": "placement", "decoder_lora_modules": "placement", "validate_placement": "placement",
}

__all__ = sorted([*_LAZY, "adapter_hash"])


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
