"""`ParallelCEDNetwork`: the reference network split over a tensor-parallel group, each rank holding only its shards.

It *is* a `CEDNetwork` (same forward, same `SessionState`, same parameter names) whose sharded submodules are
replaced by the classes of `modules.py`; the layer loop, hyper-connections, norms, caches and routing are the
single-process code, run identically on every rank on replicated activations. The collectives sit where DeepSeek's
V4.1 inference code puts them:

    embedding        all-reduce of the masked vocab-parallel lookup     (B, S, dim)        weight dtype
    engram layers    all-reduce of the masked row-parallel table lookup (B, S, cols, hd)   weight dtype
    each attention   all-reduce after the row-parallel wo_b             (B, S, dim)        fp32
    index layers     all-reduce of the per-head indexer scores          (B, S, n_entries)  fp32
    each MoE / FFN   all-reduce after shared + routed experts           (B, S, dim)        fp32
    head             all-gather of the vocab-parallel logits            (B, S, vocab / N)  fp32

Per decode token (B = S = 1), the payload each rank contributes is therefore
    4 * dim * (2 * n_layers) + b * dim + 4 * sum_index_layers(T / ratio) + 4 * vocab / N   bytes
(b = weight bytes per element, T = context length; Engram adds b * cols * hd per engram layer). An all-reduce of a
payload P moves 2 (N-1)/N * P per rank as a ring, (N-1) * P as the ordered all-gather (`comm.py`); the head's
all-gather receives (N-1)/N * 4 * vocab. The KV caches are not split: V4.1 has one K=V latent per token shared by all
heads, so every rank keeps the whole (small) cache, as in the release.

The engine roles are loaded per rank with `load_parallel_component` (each rank reads only its slices of only its
role) and run by the step modules, which add LoRA (sharded by `lora_shards.py`) and call the same collectives through
the component's `comm`. `split()` of a whole parallel network is not offered: a rank serves one role.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from ced.formats.checkpoint import CheckpointFiles, directory_token_map
from ced.formats.config_file import CheckpointError, load_config
from ced.model.config import CEDConfig
from ced.model.network import CEDNetwork, DecoderEngine, EncoderEngine, StepOutput
from ced.model.state import SessionState
from ced.parallel.comm import Comm
from ced.parallel.layout import ParallelLayout, sharding_plan
from ced.parallel.modules import (
    ParallelEngramTable,
    ParallelMoE,
    VocabParallelEmbedding,
    parallel_attention,
)
from ced.parallel.shards import SliceReader


class ParallelCEDNetwork(CEDNetwork):
    """`CEDNetwork` with this rank's shards; built on the meta device (allocate with `to_empty`, fill with
    `load_parallel_network`). Every rank must call `forward` with the same arguments in the same order."""

    bytes_read: int = 0  # checkpoint bytes the loader read from disk for this rank

    def __init__(self, cfg: CEDConfig, layout: ParallelLayout, comm: Comm) -> None:
        if (comm.world, comm.rank) != (layout.world, layout.rank):
            raise ValueError(f"layout is rank {layout.rank} of {layout.world} but the process group is rank "
                             f"{comm.rank} of {comm.world}")
        layout.check(cfg)
        with torch.device("meta"):
            super().__init__(cfg)
            shard_modules(self, cfg, layout, comm)

    layout: ParallelLayout
    comm: Comm

    def forward(self, tokens: torch.Tensor, state: SessionState | None = None, trace: bool = False,
                targets: Iterable[int] = ()) -> StepOutput:
        """As `CEDNetwork.forward`; the logits come back whole (vocab-gathered) on every rank."""
        out = super().forward(tokens, state, trace, targets)
        out.logits = self.comm.all_gather(out.logits, -1, "head")
        return out

    def split(self) -> tuple:  # type: ignore[override]
        raise NotImplementedError("the encoder/decoder engine split of a tensor-parallel network is not implemented")

    def held_bytes(self) -> int:
        """Bytes of the parameters this rank holds (its shards plus the replicated tensors)."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())


def shard_modules(module: nn.Module, cfg: CEDConfig, layout: ParallelLayout, comm: Comm) -> None:
    """Replace, in place, every sharded submodule of a network or engine component (`embed`, `head`, each block's
    attention, MoE and Engram table, whichever it has) by this rank's parallel one; the rest stays as built. Call on
    the meta device. Leaves `layout` and `comm` on the module."""
    module.layout, module.comm = layout, comm
    start, stop = layout.even_range(cfg.vocab_size)  # the same token rows for the embedding and the head
    if hasattr(module, "embed"):
        module.embed = VocabParallelEmbedding(start, stop, cfg.dim, comm, "embed")
    if hasattr(module, "head"):
        module.head = nn.Linear(cfg.dim, stop - start, bias=False)
    for key, block in module.layers.items():  # type: ignore[union-attr]
        if hasattr(block, "attn"):
            block.attn = parallel_attention(cfg, layout, int(key), comm)
        if hasattr(block, "ffn"):
            block.ffn = ParallelMoE(cfg, layout, comm)
        if block.engram is not None:
            rows, width = block.engram.embed.weight.shape
            block.engram.embed = ParallelEngramTable(*layout.ceil_range(rows), width, comm, "engram")


def load_parallel_network(directory: str | Path, comm: Comm, expert_parallel: bool = False,
                          dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> ParallelCEDNetwork:
    """This rank's shards of the checkpoint in `directory`, read slice by slice into a `ParallelCEDNetwork`.

    The network is cast to `dtype` while still on the meta device and only then allocated, so the rank's peak is its
    shards in `dtype` plus one slice in flight (none when the stored dtype is `dtype`: slices are read in place).
    The bytes read from disk are left on `net.bytes_read`.
    """
    directory = Path(directory)
    cfg = load_config(directory)
    layout = ParallelLayout(comm.world, comm.rank, expert_parallel)
    net = ParallelCEDNetwork(cfg, layout, comm)
    return load_shards(net, directory, cfg, layout, dtype, device)  # type: ignore[return-value]


def load_parallel_component(role: str, directory: str | Path, comm: Comm, expert_parallel: bool = False,
                            dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                            rank_files: Path | None = None) -> EncoderEngine | DecoderEngine:
    """This rank's shards of one engine role (`encoder`: embedding, layers 0..E-1 and layer E's attention;
    `decoder`: layer E's FFN, the decoder layers and the head), and nothing of the other role: what a rank of a
    tensor-parallel encoder or decoder holds. The step modules (`build_engines.export`) run on it unchanged; its
    collectives are the parallel modules' own plus those the steps call through `comm`. `rank_files`: a rank-local
    build (`build_engines.build.rank_build`) to read this rank's tensors from, whole, instead of slicing the
    checkpoint."""
    directory = Path(directory)
    cfg = load_config(directory)
    layout = ParallelLayout(comm.world, comm.rank, expert_parallel)
    layout.check(cfg)
    kinds = {"encoder": EncoderEngine, "decoder": DecoderEngine}
    if role not in kinds:
        raise ValueError(f"role {role!r} must be one of {sorted(kinds)}")
    with torch.device("meta"):
        component = kinds[role](cfg)
        shard_modules(component, cfg, layout, comm)
    if rank_files is None:
        return load_shards(component, directory, cfg, layout, dtype, device)  # type: ignore[return-value]
    return _load_rank_file(component, Path(rank_files) / f"rank{comm.rank}" / f"{role}.safetensors", directory, cfg,
                           dtype, device)  # type: ignore[return-value]


def _load_rank_file(module: nn.Module, path: Path, directory: Path, cfg: CEDConfig, dtype: torch.dtype,
                    device: str | torch.device) -> nn.Module:
    """Fill the meta-device `module` from its rank file, tensor by tensor; every tensor must be there at its shape."""
    from safetensors import safe_open

    net = module.to(dtype).to_empty(device=device)
    own = net.state_dict()
    with safe_open(str(path), framework="pt") as f, torch.no_grad():
        stored = set(f.keys())
        if stored != set(own):
            raise CheckpointError(f"{path}: holds {len(stored)} tensors, the rank needs {len(own)}; differing: "
                                  f"{sorted(stored ^ set(own))[:10]}")
        for name, target in own.items():
            tensor = f.get_tensor(name)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"{path}: {name} is {tuple(tensor.shape)}, the rank needs {tuple(target.shape)}")
            target.copy_(tensor)
            net.bytes_read = getattr(net, "bytes_read", 0) + tensor.numel() * tensor.element_size()  # type: ignore[assignment]
    if cfg.engram_layers and getattr(net, "engram_hasher", None) is not None:
        token_map = directory_token_map(cfg, directory)
        if token_map is not None:
            net.set_engram_token_map(token_map)  # type: ignore[operator]
    return net.eval()


def load_shards(module: nn.Module, directory: Path, cfg: CEDConfig, layout: ParallelLayout, dtype: torch.dtype,
                device: str | torch.device) -> nn.Module:
    """Allocate the meta-device `module` (cast to `dtype` first) and fill each of its tensors with this rank's slice
    of the checkpoint; sets the Engram token map where the module hashes. The bytes read go to `module.bytes_read`."""
    plan = sharding_plan(cfg, layout)
    files = CheckpointFiles(directory)
    missing = sorted(set(plan) - set(files.names()))
    if missing:
        raise CheckpointError(f"{directory}: missing tensors {missing[:10]} ({len(missing)} in all)")
    net = module.to(dtype).to_empty(device=device)
    own = net.state_dict()
    held = {name for name, (shard, _) in plan.items() if shard.held}
    if not isinstance(net, ParallelCEDNetwork):  # a component holds the held tensors of its own part
        held &= set(own)
    if set(own) != held:
        raise AssertionError(f"network and layout disagree on held tensors: {sorted(set(own) ^ held)[:10]}")
    reader = SliceReader(files)
    with torch.no_grad():
        for name, target in own.items():
            shard, shape = plan[name]
            if tuple(target.shape) != shard.local_shape(shape):
                raise AssertionError(f"{name}: the module holds {tuple(target.shape)}, the layout says "
                                     f"{shard.local_shape(shape)}")
            if target.device.type == "cpu":
                reader.read_into(name, shard, shape, target)
            else:
                host = torch.empty(target.shape, dtype=target.dtype)
                reader.read_into(name, shard, shape, host)
                target.copy_(host)
    net.bytes_read = reader.bytes_read  # type: ignore[assignment]
    if cfg.engram_layers and getattr(net, "engram_hasher", None) is not None:
        token_map = directory_token_map(cfg, directory)
        if token_map is not None:
            net.set_engram_token_map(token_map)  # type: ignore[operator]
    return net.eval()
