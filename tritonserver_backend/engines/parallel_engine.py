"""`ParallelTorchEngine`: the torch engine with the encoder and the decoder each run by a tensor-parallel group.

A role's group starts on the first step of that role, so the encoder model's process starts only encoder ranks and
the decoder model's only decoder ranks (`rank_group.py`). The pointer head (the router's, milliseconds on a pooled
H19 row) stays in one process.

DSpark on a parallel decoder: the ranks return each position's `draft_main` row with their step (computed alike on
every rank from the replicated streams, `shard_steps.py`), and the drafter graph runs on the leader alone, in this
process, with the whole drafter and the target's embedding and head (`torch_engine.target_embed_and_head`). Why on
the leader and not sharded: a draft block is a few small rows through the drafter's blocks and one head product; a
sharded drafter would add a collective per drafter layer to every step for that, and the leader already holds the
only copy of each turn's draft ring. What it costs: the leader holds the embedding and head whole (at the release's
width 2 x 129280 x 4096 in their stored dtype widened to fp32, about 4.2 GB) beside its shard (docs/parallel.md).
"""

from __future__ import annotations

from pathlib import Path

from ced.formats.drafter_files import drafter_spec
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
        self._leader: StepEngine | None = None  # the pointer head and the drafter graph, run in this process
        self.layout.drafter = drafter_spec(self.model_dir)

    def encoder(self, feed: Arrays) -> Arrays:
        return self.groups["encoder"].step(feed)

    def decoder(self, feed: Arrays) -> Arrays:
        return self.groups["decoder"].step(feed)

    def set_lora_bank(self, bank: Arrays) -> None:
        super().set_lora_bank(bank)
        self.groups["decoder"].set_bank(bank)

    def pointer(self, feed: Arrays) -> Arrays:
        return self._leader_engine().pointer(feed)

    def drafter(self, feed: Arrays) -> Arrays:
        if not self.has_drafter:
            return super().drafter(feed)
        return self._leader_engine().drafter(feed)

    def _leader_engine(self) -> StepEngine:
        """The single-process torch engine for the graphs the leader runs alone; each graph loads only what it reads
        (the pointer head; the drafter with the target's embedding and head), never the layers."""
        if self._leader is None:
            from tritonserver_backend.engines.torch_engine import TorchEngine

            self._leader = TorchEngine(self.model_dir)
        return self._leader

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
