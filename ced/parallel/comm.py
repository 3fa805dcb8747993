"""The two collectives tensor parallelism needs (sum-all-reduce, all-gather), made deterministic and counted.

Determinism. Greedy decoding across ranks must be reproducible bit for bit, and every rank must hold bitwise the same
reduced activations (they route tokens and pick top-k entries from them independently; a one-ulp difference between
ranks could make two ranks choose different experts or KV entries). `ordered=True` (the default) implements the sum
as an all-gather followed by a sum in rank order 0, 1, ..., N-1 on every rank: the result is a fixed function of the
N partial tensors, identical on all ranks and across reruns, whatever algorithm the backend picks. Its cost is
(N-1)/N * N = N-1 payloads received per rank instead of a ring all-reduce's 2(N-1)/N: the same at N=2, twice at large
N. `ordered=False` uses the backend's own all_reduce. Gloo's CPU all-reduce is deterministic for a fixed world size
(a fixed ring schedule; see the tests), so on CPU both modes are reproducible; the ordered one additionally does not
depend on the backend's algorithm choice.

On GPUs (NCCL) with `ordered=False`, reproducibility needs a fixed reduction schedule:
    NCCL_ALGO=Ring              # no tree / CollNet / NVLS algorithms, whose reduction order depends on topology
    NCCL_NVLS_ENABLE=0          # NVLink SHARP reduces inside the switch, in no guaranteed order
    NCCL_COLLNET_ENABLE=0       # likewise for in-network (SHARP) reductions
    NCCL_PROTO=Simple           # one protocol for every message size, so chunking does not change with size
    NCCL_MIN_NCHANNELS=NCCL_MAX_NCHANNELS=<k>  # a fixed channel count: chunk boundaries fix per-element order
and, for the local kernels, `torch.use_deterministic_algorithms(True)` with `CUBLAS_WORKSPACE_CONFIG=:4096:8`, the
same world size, rank-to-GPU mapping and NCCL version. The ordered mode needs none of the NCCL settings (all_gather
is a copy), only the deterministic local kernels.

Traffic. Every call adds its payload (the bytes of the tensor one rank contributes) to `traffic[tag]`, so a caller
can check the per-token communication against the formula in the package docs.
"""

from __future__ import annotations

import pickle
from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class Comm:
    """Collectives over one process group; with no initialised group (or a group of one) every call is the identity."""

    def __init__(self, group: dist.ProcessGroup | None = None, ordered: bool = True) -> None:
        """`group`: a process group (also one made by `open_group`, which torch does not register); None: the
        default group when this process has joined one."""
        self.group = group
        self.ordered = ordered
        if group is not None:
            self.world, self.rank = group.size(), group.rank()
        elif dist.is_available() and dist.is_initialized():
            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            self.world, self.rank = 1, 0
        self.traffic: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    @classmethod
    def single(cls) -> "Comm":
        """A group of one, whatever process group this process has joined: the identity collectives of a step run
        alone (the single-process engines, the ONNX export)."""
        comm = cls.__new__(cls)
        comm.group, comm.ordered, comm.world, comm.rank = None, True, 1, 0
        comm.traffic, comm.calls = Counter(), Counter()
        return comm

    def _count(self, tag: str, t: torch.Tensor) -> None:
        self.traffic[tag] += t.numel() * t.element_size()
        self.calls[tag] += 1

    def all_reduce(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """The elementwise sum of every rank's `t` (a new tensor, or `t` itself on one rank)."""
        if self.world == 1:
            return t
        self._count(tag, t)
        t = t.contiguous()
        if not self.ordered:
            out = t.clone()
            dist.all_reduce(out, group=self.group)
            return out
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        out = parts[0]
        for part in parts[1:]:
            out = out + part  # rank order, the same on every rank
        return out

    def all_gather(self, t: torch.Tensor, dim: int, tag: str) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim` in rank order."""
        if self.world == 1:
            return t
        self._count(tag, t)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim)

    def reset_traffic(self) -> None:
        self.traffic.clear()
        self.calls.clear()


def open_group(port: int, rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of `world` local processes meeting at a TCP store on `port` (rank 0 serves it).

    Not the process's default group: one process may lead several groups (an in-process pipeline leads the encoder's
    and the decoder's) and start a group again after losing a rank, which torch's single default group allows
    neither. Torch's collectives take it as `group=`; the object broadcast (`broadcast_object`) and the barrier call
    its own methods, because torch's helpers for those look groups up in a registry this one is not in."""
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=timeout_s))
    return dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))


def broadcast_object(group: dist.ProcessGroup, value: Any = None) -> Any:
    """Rank 0's `value` on every rank of `group` (pickled: its length, then its bytes)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if group.rank() == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    group.broadcast([size], options).wait()
    buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
              else torch.empty(int(size), dtype=torch.uint8))
    group.broadcast([buffer], options).wait()
    return value if group.rank() == 0 else pickle.loads(buffer.numpy().tobytes())


def barrier(group: dist.ProcessGroup) -> None:
    group.barrier().wait()
