"""LoRA adapters: identity (`adapter`), placement rules (`placement`), PEFT files (`peft_io`), the per-row bank
(`bank`). The names below are the package's public API."""

from .adapter import Adapter, AdapterError, adapter_hash
from .bank import AdapterBank
from .peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, random_adapter_weights, read_adapter, save_adapter
from .placement import UNSUPPORTED_TARGETS, decoder_lora_modules, validate_placement

__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "UNSUPPORTED_TARGETS", "Adapter", "AdapterBank", "AdapterError",
    "adapter_hash", "decoder_lora_modules", "random_adapter_weights", "read_adapter", "save_adapter", "validate_placement",
]
