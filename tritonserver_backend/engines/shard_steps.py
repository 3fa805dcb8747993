"""What one rank of a tensor-parallel encoder or decoder runs: the step module on its shard of the role.

Every rank of a group builds one of these and runs the same calls in the same order (the leader broadcasts them, see
`rank_group.py`); the step modules' collectives (`ced.parallel.comm`) meet inside each call. Rows run one at
a time as in the single-process torch engine (`torch_engine.run_encoder_rows` / `run_decoder_rows`), so every rank
issues the same sequence of collectives whatever the batch; on `whole_blocks` checkpoints they run padded to the same
fixed tiles too (`STEP_TILE` positions, `HEAD_TILE` head rows), so a rank's verify block and its one-position steps
run the same shapes, collectives included, and give a position the same bits.

DSpark: a decoder rank also returns each position's `draft_main` row. The streams entering the target layers are
replicated after each all-reduce, so every rank computes the same rows from stage 0's projection, the only drafter
tensors it reads (`load_drafter_projection`); the drafter graph runs on the leader (`parallel_engine.py`).

Why the torch engine and not rank-local ONNX graphs: onnxruntime has no collective op, so a rank-local graph would
have to stop at each of a step's ~2 * n_layers collectives and hand its tensors to Python (docs/parallel.md, "Why
the torch engine"); on GPUs the same split runs as TensorRT engines with NCCL plugin nodes, which cannot be built here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ced.formats.config_file import load_config
from ced.formats.drafter_files import load_drafter_projection
from ced.parallel.comm import Comm
from ced.parallel.layout import ParallelLayout
from ced.parallel.network import load_parallel_component
from ced.steps.decoder_step import DecoderStep
from ced.steps.draft_step import DraftMain
from ced.steps.encoder_step import EncoderStep
from ced.steps.layout import StepLayout
from ced.steps.lora_shards import LoraShards
from ced.steps.parity import torch_runner
from tritonserver_backend.engines.interface import Arrays
from tritonserver_backend.engines.torch_engine import run_decoder_rows, run_encoder_rows, whole_blocks

ROLES = ("encoder", "decoder")


class ShardSteps:
    """The `role` step of rank `comm.rank` of `comm.world`, holding only that rank's slices of the role's weights."""

    def __init__(self, model_dir: Path, role: str, comm: Comm, expert_parallel: bool,
                 rank_files: Path | None = None) -> None:
        """`rank_files`: a rank-local build to read the rank's weights from (else its slices of the checkpoint)."""
        if role not in ROLES:
            raise ValueError(f"role {role!r} must be one of {ROLES}")
        cfg = load_config(model_dir)
        self.role, self.comm = role, comm
        self.pad = whole_blocks(cfg)
        self.lora = LoraShards(cfg, ParallelLayout(comm.world, comm.rank, expert_parallel))
        self.bank: Arrays = {}
        component = load_parallel_component(role, model_dir, comm, expert_parallel, rank_files=rank_files)
        self.held_bytes = sum(t.numel() * t.element_size() for t in component.state_dict().values())
        step: torch.nn.Module
        if role == "encoder":
            layout = StepLayout(cfg)
            step, specs = EncoderStep(component), (layout.encoder_inputs(), layout.encoder_outputs())
        else:  # with a drafter, every rank computes `draft_main` on the replicated streams; the leader's is used
            drafter = load_drafter_projection(model_dir)
            layout = StepLayout(cfg, None if drafter is None else drafter.spec)
            step = DecoderStep(component, None if drafter is None else DraftMain(drafter))
            specs = layout.decoder_inputs(), layout.decoder_outputs()
        self._run = torch_runner(step.eval(), *specs)

    def set_bank(self, bank: Arrays) -> None:
        """The whole stacked adapter bank; the rank keeps its cut (`lora_shards.py`)."""
        self.bank = self.lora.cut(bank)

    def step(self, feed: Arrays) -> Arrays:
        if self.role == "encoder":
            return run_encoder_rows(self._run, feed, self.pad)
        return run_decoder_rows(self._run, feed, self.bank, self.pad)
