"""`ParallelTorchEngine`: the torch engine with the encoder and the decoder each run by a tensor-parallel group.

A role's group starts on the first step of that role, so the encoder model's process starts only encoder ranks and
the decoder model's only decoder ranks (`rank_group.py`). The pointer head (the router's, milliseconds on a pooled
H19 row) stays in one process. DSpark drafting is not offered on a parallel decoder yet: the drafter graph reads the
whole embedding and head, which a rank does not hold (docs/parallel.md), so `--speculative auto` decodes plainly.
"""

from __future__ import annotations

from pathlib import Path

from build_engines.parallel.layout import ParallelLayout, ParallelLayoutError

from .interface import Arrays, EngineUnavailable, StepEngine
from .rank_group import RankGroup


class ParallelTorchEngine(StepEngine):
    backend = "torch"

    def __init__(self, model_dir: Path, tensor_parallel_size: int, expert_parallel: bool = False, threads: int = 1) -> None:
        super().__init__(model_dir)
        try:  # refuse an impossible split at once, naming the config keys
            ParallelLayout(tensor_parallel_size, 0, expert_parallel).check(self.cfg)
        except ParallelLayoutError as error:
            raise EngineUnavailable(str(error)) from None
        self.size, self.expert_parallel = tensor_parallel_size, expert_parallel
        self.groups = {role: RankGroup(self.model_dir, role, tensor_parallel_size, expert_parallel, threads)
                       for role in ("encoder", "decoder")}
        self._pointer: StepEngine | None = None

    def encoder(self, feed: Arrays) -> Arrays:
        return self.groups["encoder"].step(feed)

    def decoder(self, feed: Arrays) -> Arrays:
        return self.groups["decoder"].step(feed)

    def set_lora_bank(self, bank: Arrays) -> None:
        super().set_lora_bank(bank)
        self.groups["decoder"].set_bank(bank)

    def pointer(self, feed: Arrays) -> Arrays:
        if self._pointer is None:
            from .torch_engine import TorchEngine

            self._pointer = TorchEngine(self.model_dir)
        return self._pointer.pointer(feed)

    def close(self) -> None:
        for group in self.groups.values():
            group.stop()

    def describe(self) -> str:
        mode = " + expert parallel" if self.expert_parallel else ""
        return f"torch, tensor parallel {self.size}{mode}"
