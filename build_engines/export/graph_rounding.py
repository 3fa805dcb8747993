"""Let a step module take its exported graph's decision where fp32 noise puts a fake-quant value on a rounding tie.

Why: with V4.1's runtime fake-quant every fp8/fp4 GEMM input is rounded onto a coarse grid. onnxruntime and torch
compute the same fp32 arithmetic in a different order (GEMM accumulation, fused kernels), so the two differ by about
1e-7 relative; now and then that lands a value on the other side of a rounding tie, the two round one grid step apart
(1/16 of the value in fp8, up to 1/2 in fp4), and over 40 quantized layers that one step spreads until the build's
parity check cannot tell a flip from a wrong graph (seen on the release-shaped checkpoint: 4e-3 on H19, other top-k).

So the parity check exposes every rounding the graph makes (the output of each `Round(v / step) * step` of
`graph_ops.round_e4m3` / `round_e2m1`) as an extra graph output, and runs the module with those two functions
patched. The graph's roundings, in the order torch.export traced them (the node names it keeps in the metadata; the
optimizer reorders the nodes themselves), are paired with the module's calls in turn: a call is paired with the next
graph rounding if the two are equal, or differ only where the module's input sits on the tie between them
(`|v - (mine + graph's) / 2| <= tol * |v| + 1e-6 * max |v| over its block`), and there the module takes the graph's
value. A call the graph has no rounding for must repeat an earlier call's input exactly (the optimizer merged the two:
one normed activation quantized for two projections) and takes what that one took. Anything else (a difference off a
tie, a rounding left unpaired) fails the check: following is allowed exactly where a correct graph and a correct module
can disagree.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch

from ced.steps import graph_ops

ROUNDING_FUNCTIONS = ("round_e4m3", "round_e2m1")
TIE_TOLERANCE = 1e-4  # relative to |v|: fp32 noise is ~1e-7 per op, far below; a grid step is >= 1/16 of |v|
# ... plus this share of the largest |v| in v's block (the last axis: a quantization block). Why: a small value that
# comes out of a cancellation carries the absolute noise of the large terms it was summed from, not noise relative to
# itself. Seen on the 40-layer release-shaped decoder: v = 0.0087881 (scaled), 9.6e-7 below the tie between the e4m3
# subnormals 4 and 5 x 2^-9, graph and module on either side; that block's largest value was ~400 (1e-6 of it: 4e-4).
BLOCK_NOISE = 1e-6


def _digest(v: torch.Tensor) -> bytes:
    """Identifies a rounding's input (shape and exact bits) in 32 bytes."""
    h = hashlib.blake2b(repr(tuple(v.shape)).encode(), digest_size=32)
    h.update(v.detach().contiguous().numpy().tobytes())
    return h.digest()


class LazyArrays(Sequence[np.ndarray]):
    """Arrays of an `.npz` file read one at a time when indexed (`np.load` of an npz reads an entry on access), so a
    check that walks thousands of rounding taps holds one of them, not all."""

    def __init__(self, archive: "np.lib.npyio.NpzFile", keys: list[str]) -> None:
        self.archive, self.keys = archive, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        if isinstance(i, slice):
            return [self.archive[k] for k in self.keys[i]]
        return self.archive[self.keys[i]]


class RoundingMismatch(RuntimeError):
    """The graph's roundings cannot be paired with the module's (a different count, shape, or a mismatch off a tie)."""


def _call_index(node: onnx.NodeProto) -> int:
    """Which `aten.round` call of the traced module a Round node is: torch.export names them round, round_1, ... in
    the order the module made them, and the exporter keeps that name in the node's metadata."""
    fx = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")
    match = re.match(r"%round(?:_(\d+))? ", fx)
    if match is None:
        raise RoundingMismatch(f"Round node {node.name!r} carries no exporter metadata naming its call ({fx[:60]!r})")
    return int(match.group(1) or 0)


def rounding_outputs(model: onnx.ModelProto) -> list[str]:
    """The graph's rounded values (the Mul after each Round: `Round(v / step) * step`) in the module's call order.

    Calls missing from the graph are ones the optimizer merged with an identical earlier one (the same input rounded
    twice, e.g. one normed activation quantized for two projections)."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    names = {}
    for node in model.graph.node:
        if node.op_type != "Round":
            continue
        users = consumers.get(node.output[0], [])
        if len(users) != 1 or users[0].op_type != "Mul":
            raise RoundingMismatch(f"Round node {node.name!r} is not followed by one Mul (the grid step): "
                                   f"{[u.op_type for u in users]}; graph_ops' rounding changed shape")
        names[_call_index(node)] = users[0].output[0]
    return [names[k] for k in sorted(names)]


TAP_SUFFIX = "__tap_fp16"


def write_tapped_graph(path: Path, tapped: Path) -> list[str]:
    """Write a copy of the graph at `path` to `tapped` (same folder, so external data stays valid) that also outputs
    every rounded value; returns the names of those outputs in the module's call order (none, and no copy, for a
    graph without fake-quant).

    The taps come out as float16, exactly: a rounding's output is an e4m3 value (|v| <= 448, 3 mantissa bits, steps
    down to 2^-9) or an e2m1 value (0 .. 6), the block scale applied after it, and float16 holds every such value
    (10 mantissa bits, normal from 2^-14). Why: onnxruntime holds every declared output until the run returns, and
    the decoder's taps (every expert's input on every check row) are the largest of them; half the bytes. Were a tap
    ever not exact, it would differ from the module's rounding off a tie and the check would fail, not pass."""
    if tapped.parent.resolve() != path.parent.resolve():
        raise ValueError("the tapped copy must sit beside the graph: its external data is referenced by relative path")
    model = onnx.load(str(path), load_external_data=False)
    names = rounding_outputs(model)
    if not names:
        return []
    model.graph.node.extend(onnx.helper.make_node("Cast", [n], [n + TAP_SUFFIX], to=onnx.TensorProto.FLOAT16)
                            for n in names)
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n + TAP_SUFFIX, onnx.TensorProto.FLOAT16, None)
                              for n in names)
    onnx.save(model, str(tapped))
    return [n + TAP_SUFFIX for n in names]


@dataclass
class FollowGraphRounding:
    """The graph's rounded values of one run, and what following them took (filled while the module runs)."""

    values: Sequence[np.ndarray]  # the graph's rounded values, in the module's call order (may read lazily)
    tol: float = TIE_TOLERANCE
    calls: int = 0
    elements: int = 0
    flips: int = 0
    unmatched: int = 0
    merged: int = 0
    problems: list[str] = field(default_factory=list)
    _next: int = 0
    # per distinct input (a digest of its shape and bytes): what it took where that differs from the module's own
    # rounding (a followed flip, rare), else None. Digests, not the inputs and results themselves: those would keep
    # two copies of every rounded activation of the run alive until the end of the check
    _seen: dict[bytes, torch.Tensor | None] = field(default_factory=dict)

    def _follow(self, real: Callable[[torch.Tensor], torch.Tensor],
                name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def rounding(v: torch.Tensor) -> torch.Tensor:
            mine = real(v)
            k, self.calls = self.calls, self.calls + 1
            self.elements += mine.numel()
            key = _digest(v)
            paired = self._pair(v, mine) if self._next < len(self.values) else None
            if paired is None:  # merged in the graph into an identical earlier call: take what that one took
                self.merged += 1
                if key in self._seen:
                    taken = self._seen[key]
                    return mine if taken is None else taken  # the same input rounds to the same `mine`
                self.problems.append(f"rounding #{k} ({name}, shape {tuple(mine.shape)}): the graph's next rounding "
                                     f"(#{self._next}) differs off a tie, and no earlier call had this input")
                self.unmatched += mine.numel()
                return mine
            taken, flipped = paired
            self._seen[key] = taken if flipped else None
            return taken

        return rounding

    def _pair(self, v: torch.Tensor, mine: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
        """(value taken, whether a tie was flipped) if the graph's next rounding is this call's (equal, or different
        only on ties: then the graph's side is taken), else None."""
        graph = torch.from_numpy(np.ascontiguousarray(self.values[self._next], dtype=np.float32))  # float16 taps: exact
        if graph.shape != mine.shape:
            return None
        differ = mine != graph
        noise = v.abs().amax(-1, keepdim=True) * BLOCK_NOISE if v.ndim else torch.zeros(())
        tie = (v - (mine + graph) * 0.5).abs() <= self.tol * v.abs() + noise
        if bool((differ & ~tie).any()):
            return None
        self._next += 1
        flips = int(differ.sum())
        self.flips += flips
        return (torch.where(differ, graph, mine), True) if flips else (mine, False)

    @contextlib.contextmanager
    def patched(self) -> Iterator[FollowGraphRounding]:
        """graph_ops' rounding functions follow the graph inside the block (the QDQ functions look them up there)."""
        saved = {name: getattr(graph_ops, name) for name in ROUNDING_FUNCTIONS}
        try:
            for name, real in saved.items():
                setattr(graph_ops, name, self._follow(real, name))
            yield self
        finally:
            for name, real in saved.items():
                setattr(graph_ops, name, real)

    def check(self, what: str, max_flip_share: float = 1e-3) -> None:
        """Raise unless every rounding was paired, off-tie differences are none and flips are rare."""
        if self._next != len(self.values):
            self.problems.append(f"{len(self.values) - self._next} of the graph's {len(self.values)} roundings were "
                                 f"paired with none of the module's {self.calls}")
        if self.flips > max(8, max_flip_share * self.elements):
            self.problems.append(f"{self.flips} rounding flips in {self.elements} values: too many to be fp32 noise")
        if self.problems:
            raise RoundingMismatch(f"{what}: the graph's fake-quant roundings differ from the module's: "
                                   + "; ".join(self.problems[:6]))

    def figures(self) -> dict[str, int]:
        return {"roundings": self.calls, "merged_in_graph": self.merged, "rounded_values": self.elements,
                "flips_followed": self.flips}
