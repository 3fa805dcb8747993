"""Model ids: `mol2` lets MoL2 route every turn, `mol2:base` answers without an adapter, `mol2:<name>` names a loaded
adapter (the `adapter` tensor). One id per choice, so `GET /v1/models` lists what a client may pick."""

from __future__ import annotations

ROUTED = "mol2"
BASE = "base"
SEPARATOR = ":"


def model_id(adapter: str | None) -> str:
    return ROUTED if adapter is None else f"{ROUTED}{SEPARATOR}{adapter}"


def parse(model: str) -> str | None:
    """-> the explicit adapter (None = route); ValueError for an id outside the `mol2` family."""
    if model == ROUTED:
        return None
    prefix = ROUTED + SEPARATOR
    if model.startswith(prefix) and len(model) > len(prefix):
        return model[len(prefix):]
    raise ValueError(model)


def served(adapters: list[str]) -> list[str]:
    return [ROUTED, model_id(BASE)] + [model_id(a) for a in adapters]
