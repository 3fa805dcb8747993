"""The reference engine: the step modules run eagerly by PyTorch, one row at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ced.formats.checkpoint import CheckpointFiles, load_checkpoint
from ced.formats.drafter_files import drafter_spec, load_drafter
from ced.model.config import CEDConfig
from ced.model.dspark import DSpark
from ced.model.network import DecoderEngine, EncoderEngine
from ced.routing.pointer_head import load_router_head
from ced.steps.decoder_step import DecoderStep
from ced.steps.draft_step import DraftMain, DraftStep
from ced.steps.encoder_step import EncoderStep
from ced.steps.lora_grid import lora_grid, row_slots
from ced.steps.parity import torch_runner
from ced.steps.pointer_step import PointerStep
from tritonserver_backend.engines.interface import Arrays, StepEngine

PER_ROW = {"encoder": ("tokens", "start", "rings"),
           "decoder": ("streams", "ffn_pre", "topk", "candidates", "start", "ring_start", "rings", "kv", "index_k",
                       "verify")}


class TorchEngine(StepEngine):
    backend = "torch"

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self._runners: dict[str, Callable[[Arrays], Arrays]] = {}
        self.layout.drafter = drafter_spec(model_dir)

    def _runner(self, graph: str) -> Callable[[Arrays], Arrays]:
        """Built on first use, so a process that only routes never loads the network."""
        if graph not in self._runners:
            layout = self.layout
            if graph == "pointer":
                head, _ = load_router_head(self.model_dir, self.cfg.dim)
                self._runners[graph] = torch_runner(PointerStep(head).eval(),
                                                    layout.pointer_inputs(self.cfg.dim, head.cfg.width),
                                                    layout.pointer_outputs())
            elif graph == "drafter":
                embed, head = target_embed_and_head(self.model_dir, self.cfg)
                self._runners[graph] = torch_runner(DraftStep(self._drafter(), embed, head).eval(),
                                                    layout.drafter_inputs(), layout.drafter_outputs())
            else:
                net = load_checkpoint(self.model_dir)
                state = net.state_dict()
                if graph == "encoder":
                    step: torch.nn.Module = EncoderStep(EncoderEngine.from_state_dict(self.cfg, state).eval())
                    specs = layout.encoder_inputs(), layout.encoder_outputs()
                else:
                    step = DecoderStep(DecoderEngine.from_state_dict(self.cfg, state).eval(),
                                       DraftMain(self._drafter()) if self.has_drafter else None)
                    specs = layout.decoder_inputs(), layout.decoder_outputs()
                self._runners[graph] = torch_runner(step.eval(), *specs)
        return self._runners[graph]

    def _drafter(self) -> DSpark:
        drafter = load_drafter(self.model_dir)
        assert drafter is not None, "the layout has a drafter spec, so the model directory ships a drafter"
        return drafter

    def encoder(self, feed: Arrays) -> Arrays:
        return run_encoder_rows(self._runner("encoder"), feed)

    def decoder(self, feed: Arrays) -> Arrays:
        return run_decoder_rows(self._runner("decoder"), feed, self.lora_bank)

    def pointer(self, feed: Arrays) -> Arrays:
        return _by_row(self._runner("pointer"), feed, batch_inputs={"h19", "option_mask"})

    def drafter(self, feed: Arrays) -> Arrays:
        if not self.has_drafter:
            return super().drafter(feed)
        return _by_row(self._runner("drafter"), feed, batch_inputs=set(feed))


def run_encoder_rows(run: Callable[[Arrays], Arrays], feed: Arrays) -> Arrays:
    """An encoder step, row by row (each row's stores and Engram rows are its own)."""
    stores = {k for k in feed if k.startswith(("kv_", "index_k_", "pending_", "engram_rows_"))}
    return _by_row(run, feed, batch_inputs=set(PER_ROW["encoder"]) | stores)


def run_decoder_rows(run: Callable[[Arrays], Arrays], feed: Arrays, bank: Arrays) -> Arrays:
    """A decoder step, row by row like every step here, each row with its own one-slot LoRA grid over `bank`."""
    slots, steps = row_slots(feed), feed["streams"].shape[1]
    return _by_row(run, {**feed, **bank}, batch_inputs=set(PER_ROW["decoder"]),
                   row_inputs=lambda b: lora_grid([int(slots[b])], steps))


def target_embed_and_head(model_dir: Path, cfg: CEDConfig) -> tuple[nn.Embedding, nn.Linear]:
    """The target's embedding and head alone, read from the checkpoint: all the drafter graph needs of the target.
    Why not the whole network: a process that drafts without running the target's layers (the leader of a
    tensor-parallel decoder, whose ranks hold the layers) would otherwise read and hold every layer for nothing."""
    files = CheckpointFiles(model_dir)
    with torch.no_grad():
        embed = nn.Embedding.from_pretrained(files.read_float("embed.weight"), freeze=True)
        head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head.weight = nn.Parameter(files.read_float("head.weight"), requires_grad=False)
    return embed.eval(), head.eval()


def _by_row(run, feed: Arrays, batch_inputs: set[str], row_inputs: Callable[[int], Arrays] | None = None) -> Arrays:  # type: ignore[no-untyped-def]
    """Run each batch row alone and stack the results: PyTorch's CPU GEMM picks kernels by row count, so a row's
    result would otherwise depend on how many other rows share the call. `row_inputs(b)` replaces inputs that are
    not sliced by row (the decoder's LoRA grid) with row b's own."""
    rows = next(feed[k] for k in batch_inputs if k in feed).shape[0]
    if rows == 1:
        return run(feed)
    parts = [run({**{k: (v[b:b + 1] if k in batch_inputs else v) for k, v in feed.items()},
                  **(row_inputs(b) if row_inputs else {})})
             for b in range(rows)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
