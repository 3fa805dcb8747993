"""One loaded adapter and its identity: the 31-bit FNV-1a hash of its path that travels as ADAPTER_HASH."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ced.lora.identity import adapter_hash


class AdapterError(ValueError):
    """An adapter that cannot be loaded or used; the message names the adapter and the offending modules."""


@dataclass
class Adapter:
    """One loaded adapter version: name, path, identity hash and per-module (A, B) factors."""

    name: str
    path: str
    rank: int
    alpha: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A (r, in), B (out, r))
    version: str  # sha256 of the weights file: distinguishes an update of the same path
    hash: int = field(init=False)

    def __post_init__(self) -> None:
        self.hash = adapter_hash(self.path)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self) -> list[str]:
        return sorted(self.weights)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())
