"""Rank-local weights: `python -m build_engines build --tensor-parallel-size N [--enable-expert-parallel]`.

Writes, for each rank r of N, `rank<r>/encoder.safetensors` and `rank<r>/decoder.safetensors` holding exactly that
rank's slices of each role (the tensors `parallel.network.load_parallel_component` would read; stored floats keep
their dtype, quantized release tensors are written dequantized to fp32), plus one `manifest.json` (layout, the
checkpoint's file digests, the bytes of every rank and role). A rank of a served group whose `engine_dir` holds such
a build reads its two files whole instead of slicing the checkpoint: a deployment can copy each node only its ranks'
files, and a rank reads exactly its bytes (a column slice of the checkpoint reads whole rows).

They are weights for the torch engine, the one that runs multi-rank (docs/parallel.md, "Why the torch engine"):
rank-local ONNX/TensorRT graphs would need collectives as plugin nodes, which cannot be built here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ced.engine_dir.manifest import source_digest
from ced.engine_dir.rank_manifest import KIND, code_digest, rank_file
from ced.formats.checkpoint import HEADER_TORCH_DTYPES, CheckpointFiles, scale_name_of
from ced.formats.config_file import load_config
from ced.model.network import DecoderEngine, EncoderEngine
from ced.parallel.comm import Comm
from ced.parallel.layout import ParallelLayout, sharding_plan
from ced.parallel.network import shard_modules
from ced.parallel.shards import SliceReader

ROLES = {"encoder": EncoderEngine, "decoder": DecoderEngine}


def placement_comm(world: int, rank: int) -> Comm:
    """A comm that only says where a rank sits: building shapes on the meta device communicates nothing."""
    comm = Comm.single()
    comm.world, comm.rank = world, rank
    return comm


def role_names(cfg: Any, layout: ParallelLayout, role: str) -> dict[str, tuple[int, ...]]:
    """The tensor names and local shapes a rank holds of one role."""
    with torch.device("meta"):
        component = ROLES[role](cfg)
        shard_modules(component, cfg, layout, placement_comm(layout.world, layout.rank))
    return {name: tuple(t.shape) for name, t in component.state_dict().items()}


def build_rank_shards(model_dir: Path, out: Path, world: int, expert_parallel: bool) -> dict[str, Any]:
    """Write every rank's files and the manifest; idempotent per file (written to a temporary name, then renamed)."""
    t0 = time.perf_counter()
    cfg = load_config(model_dir)
    files = CheckpointFiles(model_dir)
    ranks = []
    for rank in tqdm(range(world), desc="ranks"):
        layout = ParallelLayout(world, rank, expert_parallel)
        plan = sharding_plan(cfg, layout)
        reader = SliceReader(files)
        sizes = {}
        for role in ROLES:
            tensors = {}
            for name, shape in role_names(cfg, layout, role).items():
                shard, whole = plan[name]
                stored = files.tensors[name]
                quantized = scale_name_of(name) in files.tensors
                dtype = torch.float32 if quantized else HEADER_TORCH_DTYPES[stored.dtype]
                target = torch.empty(shape, dtype=dtype)
                reader.read_into(name, shard, whole, target)
                tensors[name] = target
            path = rank_file(out, rank, role)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            save_file(tensors, str(partial), metadata={"rank": str(rank), "world": str(world), "role": role})
            partial.replace(path)
            sizes[role] = path.stat().st_size
        ranks.append({"rank": rank, "bytes": sizes})
    return {"kind": KIND, "tensor_parallel_size": world, "expert_parallel": expert_parallel,
            "source": source_digest(Path(model_dir)), "code_digest": code_digest(), "ranks": ranks,
            "build_seconds": round(time.perf_counter() - t0, 1),
            "command": f"python -m build_engines build --model {model_dir} --out {out} --tensor-parallel-size {world}"
                       + (" --enable-expert-parallel" if expert_parallel else "")}
