"""`ParallelTorchEngine`: the torch engine with the encoder and the decoder each run by a tensor-parallel group.

A role's group starts on the first step of that role, so the encoder model's process starts only encoder ranks and
the decoder model's only decoder ranks (`rank_group.py`). The pointer head (the router's, milliseconds on a pooled
H19 row) stays in one process. DSpark drafting is not offered on a parallel decoder yet: the drafter graph reads the
whole embedding and head, which a rank does not hold (docs/parallel.md), so `--speculative auto` decodes plainly.
"""

from __future__ import annotations

from pathlib import Path

from ced.parallel.layout import ParallelLayout, ParallelLayoutError
from tritonserver_backend.engines.interface import Arrays, EngineUnavailable, StepEngine
from tritonserver_backend.engines.rank_group import RankGroup


class ParallelTorchEngine(StepEngine):
    backend = "torch"

    def __init__(self, model_dir: Path, tensor_parallel_size: int, expert_parallel: bool = False, threads: int = 1,
                 engine_dir: Path | None = None) -> None:
        """`engine_dir`: where a rank-local build (`python -m build_engines build --tensor-parallel-size N`) may be;
        without one (e.g. the default's ONNX engines) every rank reads its slices of the checkpoint."""
        super().__init__(model_dir)
        try:  # refuse an impossible split at once, naming the config keys
            ParallelLayout(tensor_parallel_size, 0, expert_parallel).check(self.cfg)
        except ParallelLayoutError as error:
            raise EngineUnavailable(str(error)) from None
        self.size, self.expert_parallel = tensor_parallel_size, expert_parallel
        self.rank_files = rank_build_in(engine_dir, self.model_dir, tensor_parallel_size, expert_parallel)
        self.groups = {role: RankGroup(self.model_dir, role, tensor_parallel_size, expert_parallel, threads,
                                       rank_files=self.rank_files) for role in ("encoder", "decoder")}
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
            from tritonserver_backend.engines.torch_engine import TorchEngine

            self._pointer = TorchEngine(self.model_dir)
        return self._pointer.pointer(feed)

    def close(self) -> None:
        for group in self.groups.values():
            group.stop()

    def describe(self) -> str:
        mode = " + expert parallel" if self.expert_parallel else ""
        source = f"rank-local weights in {self.rank_files}" if self.rank_files else "slices of the checkpoint"
        return f"torch, tensor parallel {self.size}{mode}, {source}"


def rank_build_in(engine_dir: Path | None, model_dir: Path, world: int, expert_parallel: bool) -> Path | None:
    """`engine_dir` when it holds a current rank-local build for this layout; None when it holds none (each rank then
    slices the checkpoint); a rank-local build that is stale or for another layout is an error naming the command."""
    if engine_dir is None or not (Path(engine_dir) / "manifest.json").exists():
        return None
    import json

    from ced.engine_dir.rank_manifest import KIND, stale_reason

    if json.loads((Path(engine_dir) / "manifest.json").read_text()).get("kind") != KIND:
        return None  # single-rank engines (the default's ONNX graphs): not for the ranks
    reason = stale_reason(Path(engine_dir), model_dir, world, expert_parallel)
    if reason is not None:
        command = (f"python -m build_engines build --model {model_dir} --out {engine_dir} --tensor-parallel-size "
                   f"{world}"
                   + (" --enable-expert-parallel" if expert_parallel else ""))
        raise EngineUnavailable(f"the rank-local weights in {engine_dir} cannot be used ({reason}); build them with "
                                f"`{command}`")
    return Path(engine_dir)
