"""The router model's logic: MoL2 pointer head over the loaded adapters' descriptions; explicit adapters win."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ced.routing.pointer_head import OptionCache, load_router_head, option_text
from ced.steps.pointer_step import option_inputs
from ced.text.tokenizer import ChatTokenizer
from tritonserver_backend.adapters.registry import BASE_NAME, Registry
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.engines import StepEngine, open_engine
from tritonserver_backend.errors import BadRequest, ServingError

UNLOADED = -1  # ADAPTER_HASH of a turn whose explicit adapter is not loaded: the decoder rejects it


def token_embedding(model_dir: Path) -> torch.Tensor:
    """`embed.weight` as fp32, read alone from whichever shard holds it (ours: model.safetensors; a release: its
    index), dequantized as the loader does (bf16 in the release)."""
    from ced.formats.checkpoint import CheckpointFiles

    return CheckpointFiles(model_dir).read_float("embed.weight")


class RouterService:
    """The option side (descriptions through the token embedding, the head's option layers) is computed here once per
    adapter set; each request's pooled H19 is scored by the engine's pointer step (`mol2::PointerScore`)."""

    def __init__(self, model_dir: str | Path, registry: Registry, counters: Counters | None = None,
                 engine: StepEngine | None = None) -> None:
        model_dir = Path(model_dir)
        self.engine = engine or open_engine("torch", model_dir)
        self.registry = registry
        self.counters = counters or Counters()
        self.tokenizer = ChatTokenizer.load(model_dir)
        self.embed = token_embedding(model_dir)  # the option side sees the token embedding only
        self.head, self.trained = load_router_head(model_dir, self.embed.shape[1])
        self._options: OptionCache | None = None
        self._option_names: list[str] = []
        self._option_key: tuple[tuple[str, str], ...] | None = None  # None: nothing cached yet
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Recompute the cached option side when the adapter set or a description changed.

        The cache is keyed on the entries themselves, not on `Registry.refresh()` reporting a change: a registry
        object shared with another reader (the admin service or the decoder in one process) may have consumed that
        report already, and the router would keep routing over the old adapter set."""
        self.registry.refresh()
        entries = self.registry.entries()
        key = tuple((e.name, e.description) for e in entries)
        if key == self._option_key:
            return
        self._option_key = key
        self._option_names = [e.name for e in entries]
        embedded = [self.embed[torch.tensor(self.tokenizer.encode(option_text(e.description or e.name)))]
                    for e in entries]
        self._options = self.head.encode_options(embedded) if embedded else None

    @torch.no_grad()
    def route(self, h19: Sequence[np.ndarray], explicit: Sequence[str | None]) -> list[int | ServingError]:
        """One ADAPTER_HASH (or an error) per request; an explicit adapter is taken as is, never scored."""
        self.refresh()
        results: list[int | ServingError] = [0] * len(h19)
        to_score = []
        for i, (h, name) in enumerate(zip(h19, explicit)):
            if name:
                try:
                    results[i] = 0 if name == BASE_NAME else self.registry.by_name(name).hash
                    self.counters.add(k.EXPLICIT, name)
                    self.counters.add(k.WRITTEN, name)
                except ServingError as exc:
                    results[i] = exc
            elif h.ndim != 1 or h.shape[0] != self.embed.shape[1] or not np.isfinite(h).all():
                results[i] = BadRequest(f"H19 must be a finite vector of {self.embed.shape[1]} values, got shape "
                                        f"{h.shape}")
            else:
                to_score.append(i)
        if to_score:
            if self._options is None:
                for i in to_score:
                    results[i] = 0  # no adapter loaded: the base model answers
                    self.counters.add(k.WRITTEN, BASE_NAME)
            else:
                feed = {name: t.numpy() for name, t in option_inputs(self._options).items()}
                feed["h19"] = np.stack([h19[i] for i in to_score]).astype(np.float32)
                feed["option_mask"] = np.ones((len(to_score), len(self._option_names)), dtype=np.bool_)
                picks = self.engine.pointer(feed)["logits"].argmax(-1).tolist()
                for i, p in zip(to_score, picks):
                    entry = self.registry.by_name(self._option_names[p])
                    results[i] = entry.hash
                    self.counters.add(k.WRITTEN, entry.name)
        return results
