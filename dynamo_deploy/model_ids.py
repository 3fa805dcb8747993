"""Model ids on Dynamo's OpenAI frontend: `mol2-small` lets MoL2 route every turn, `mol2-small:base` answers without
an adapter, `mol2-small:<name>` names an adapter of the registry (the project's Triton frontend does the same with
`mol2`, `mol2:base`, `mol2:<name>`).

Each explicit id is registered by the encoder workers as a Dynamo LoRA model card (`register_model(lora_name=...,
base_model_path=...)`) on the same `generate` endpoint, the mechanism Dynamo's own LoRA backends use: the frontend
lists it in `/v1/models` and passes the requested id to the worker as the request's `model`. An explicit adapter on
the request always wins over routing: the router step takes it as is and never scores the turn.
"""

from __future__ import annotations

from dynamo_deploy.worker_common import MODEL_NAME
from tritonserver_backend.adapters.registry import BASE_NAME, Registry

SEPARATOR = ":"


def model_id(adapter: str | None) -> str:
    return MODEL_NAME if adapter is None else f"{MODEL_NAME}{SEPARATOR}{adapter}"


def explicit_adapter(model: str | None) -> str | None:
    """The request's model id -> the adapter it names (None: route the turn); ValueError for another family."""
    if not model or model == MODEL_NAME:
        return None
    prefix = MODEL_NAME + SEPARATOR
    if model.startswith(prefix) and len(model) > len(prefix):
        return model[len(prefix):]
    raise ValueError(f"model {model!r} is not served here; ids are {MODEL_NAME!r} and {prefix}<adapter>")


def explicit_ids(registry: Registry) -> list[str]:
    """The ids a client may name: the base model and every adapter of the registry at start-up (pass a Registry of
    its own: refreshing a shared one would hide a change from the router's next refresh)."""
    registry.refresh()
    return [model_id(BASE_NAME)] + [model_id(e.name) for e in registry.entries()]
