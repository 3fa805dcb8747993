"""Where an adapter may act: layer 20's FFN and the decoder layers after it, never the encoder side.

Placement is the whole trick of MoL2 on a CED: adapters may touch only the first decoder layer's FFN and the decoder
layers after it, so the encoder state and the global KV stay adapter-independent and one history serves every
adapter. `validate_placement` enforces that at load, listing every offending module at once.
"""

from __future__ import annotations

import re
from typing import Sequence

from torch import nn

from ced.lora.adapter import AdapterError
from ced.model.config import CEDConfig

# Grouped block-diagonal projection used through its weight directly (einsum), not as a Linear call.
UNSUPPORTED_TARGETS = re.compile(r"\.attn\.wo_a$")


def decoder_lora_modules(cfg: CEDConfig, model: nn.Module,
                         include_first_decoder_ffn: bool = True) -> dict[str, nn.Linear]:
    """The Linear modules an adapter may target: layer 20's FFN (unless `no20`) and every Linear of 21..39."""
    E = cfg.first_decoder_layer
    allowed: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or UNSUPPORTED_TARGETS.search(name):
            continue
        parts = name.split(".")
        if len(parts) < 3 or parts[0] != "layers":
            continue
        layer = int(parts[1])
        if layer > E or (include_first_decoder_ffn and layer == E and parts[2] == "ffn"):
            allowed[name] = module
    return allowed


def validate_placement(cfg: CEDConfig, modules: Sequence[str], known: set[str]) -> None:
    """Refuse adapters that touch the encoder or layer 20's attention (its compressor and indexer included).

    `known` is the set of every Linear module name in the network. All offending modules are listed at once.
    """
    E = cfg.first_decoder_layer
    unknown = sorted(m for m in modules if m not in known)
    encoder_side: list[str] = []
    unsupported: list[str] = []
    for m in modules:
        if m in unknown:
            continue
        parts = m.split(".")
        if parts[0] != "layers" or int(parts[1]) < E or (int(parts[1]) == E and parts[2] != "ffn"):
            encoder_side.append(m)
        elif UNSUPPORTED_TARGETS.search(m):
            unsupported.append(m)
    problems = []
    if unknown:
        problems.append(f"target modules that do not exist: {unknown}")
    if encoder_side:
        problems.append(
            f"modules on the encoder side (encoder layers, layer {E} attention with its compressor and indexer, "
            f"embedding, head) would make the shared history adapter-dependent: {sorted(encoder_side)}"
        )
    if unsupported:
        problems.append("modules LoRA cannot target (grouped projection used through its weight): "
                        f"{sorted(unsupported)}")
    if problems:
        raise AdapterError("; ".join(problems))
