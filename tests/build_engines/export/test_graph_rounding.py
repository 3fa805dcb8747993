"""The build's parity check follows a graph's fake-quant rounding only on ties (build_engines/export/graph_rounding.py).

What must hold: a module paired with its own graph passes and takes the graph's value exactly where its input sits on
a rounding tie; a difference anywhere else, a rounding the module never makes, or a merged call whose input was never
seen fails; and on a real export (where the optimizer merges identical roundings and reorders nodes) the pairing
finds every rounding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from build_engines.build.onnx_build import ort_runner
from build_engines.export.graph_rounding import (
    TAP_SUFFIX,
    FollowGraphRounding,
    RoundingMismatch,
    rounding_outputs,
    write_tapped_graph,
)
from build_engines.export.onnx_export import export_module
from ced.steps import graph_ops
from ced.steps.layout import GraphTensor

# e4m3 in [1, 2) has step 1/8: 1.0625 is the tie between 1.0 and 1.125 (ties to even: 1.0), 1.03 is not a tie
TIE, OFF_TIE = 1.0625, 1.03


def _round(follow: FollowGraphRounding, *values: float) -> torch.Tensor:
    with follow.patched():
        return graph_ops.round_e4m3(torch.tensor(values, dtype=torch.float32))


def test_a_tie_takes_the_graphs_side_and_nothing_else_changes() -> None:
    follow = FollowGraphRounding([np.array([1.125, 1.0], dtype=np.float32)])
    assert graph_ops.round_e4m3(torch.tensor([TIE])).item() == 1.0, "round half to even, unpatched"
    assert _round(follow, TIE, 1.01).tolist() == [1.125, 1.0]
    follow.check("tie")
    assert follow.figures() == {"roundings": 1, "merged_in_graph": 0, "rounded_values": 2, "flips_followed": 1}
    assert graph_ops.round_e4m3(torch.tensor([TIE])).item() == 1.0, "the patch ends with the block"


def test_a_difference_off_a_tie_fails() -> None:
    follow = FollowGraphRounding([np.array([1.125], dtype=np.float32)])
    assert _round(follow, OFF_TIE).tolist() == [1.0], "not followed"
    with pytest.raises(RoundingMismatch, match="differs off a tie"):
        follow.check("off tie")


def test_a_merged_call_takes_what_its_twin_took_and_an_unseen_one_fails() -> None:
    follow = FollowGraphRounding([np.array([1.125], dtype=np.float32), np.array([2.0], dtype=np.float32)])
    with follow.patched():
        first = graph_ops.round_e4m3(torch.tensor([TIE]))
        twin = graph_ops.round_e4m3(torch.tensor([TIE]))  # the graph computed it once
        last = graph_ops.round_e4m3(torch.tensor([2.0]))
    assert (first.item(), twin.item(), last.item()) == (1.125, 1.125, 2.0)
    follow.check("merged")
    assert follow.merged == 1 and follow.flips == 1
    unseen = FollowGraphRounding([np.array([2.0], dtype=np.float32)])
    _round(unseen, 1.5)
    with pytest.raises(RoundingMismatch):
        unseen.check("unseen")


def test_a_graph_rounding_the_module_never_makes_fails() -> None:
    follow = FollowGraphRounding([np.array([1.0], dtype=np.float32), np.array([3.0], dtype=np.float32)])
    _round(follow, 1.0)
    with pytest.raises(RoundingMismatch, match="paired with none"):
        follow.check("extra")


def test_too_many_flips_are_not_noise() -> None:
    n = 64
    follow = FollowGraphRounding([np.full(n, 1.125, dtype=np.float32)])
    _round(follow, *[TIE] * n)
    with pytest.raises(RoundingMismatch, match="too many"):
        follow.check("systematic", max_flip_share=1e-3)


class TwoProjections(torch.nn.Module):
    """One activation quantized for two projections (the optimizer merges the two identical roundings), then fp4."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(64, 64, generator=generator) / 8)
        self.b = torch.nn.Parameter(torch.randn(64, 32, generator=generator) / 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = graph_ops.fp8_qdq(x) @ self.a
        g = graph_ops.fp8_qdq(x) @ self.b
        return graph_ops.fp4_qdq_ue8m0(h), g


def test_a_real_export_pairs_every_rounding(tmp_path: Path) -> None:
    module = TwoProjections().eval()
    path = tmp_path / "two.onnx"
    export_module(module, [GraphTensor("x", "float32", ("n", 64))], [GraphTensor("h", "float32", ("n", 64)),
                                                                      GraphTensor("g", "float32", ("n", 32))], {"n": 5},
                  path)
    names = write_tapped_graph(path, tmp_path / ".two.rounding.onnx")
    assert ([n.removesuffix(TAP_SUFFIX) for n in names]
            == rounding_outputs(onnx.load(str(tmp_path / ".two.rounding.onnx"))))
    x = np.random.default_rng(1).standard_normal((7, 64)).astype(np.float32)
    got = ort_runner(tmp_path / ".two.rounding.onnx")({"x": x})
    taps = [got.pop(n) for n in names]
    assert all(t.dtype == np.float16 for t in taps), "taps travel as float16 (exact for every rounded value)"
    follow = FollowGraphRounding(taps)
    with follow.patched(), torch.no_grad():
        h, g = module(torch.from_numpy(x))
    follow.check("two projections")
    assert follow.calls == 3 and follow.merged == follow.calls - len(names), (follow.figures(), names)
    assert np.abs(h.numpy() - got["h"]).max() < 1e-5 and np.abs(g.numpy() - got["g"]).max() < 1e-5
    # a graph that computes something else before a rounding is caught there, not averaged away at the outputs
    model = onnx.load(str(path))
    weight = next(i for i in model.graph.initializer if onnx.numpy_helper.to_array(i).shape == (64, 64))
    wrong = onnx.numpy_helper.to_array(weight).copy()
    wrong[:, 0] *= 1.5
    weight.CopyFrom(onnx.numpy_helper.from_array(wrong, weight.name))
    onnx.save(model, str(tmp_path / "wrong.onnx"))
    names = write_tapped_graph(tmp_path / "wrong.onnx", tmp_path / ".wrong.rounding.onnx")
    got = ort_runner(tmp_path / ".wrong.rounding.onnx")({"x": x})
    follow = FollowGraphRounding([got.pop(n) for n in names])
    with follow.patched(), torch.no_grad():
        module(torch.from_numpy(x))
    with pytest.raises(RoundingMismatch):
        follow.check("wrong weight")


def test_a_graph_without_fake_quant_is_not_copied(tmp_path: Path) -> None:
    module = torch.nn.Linear(8, 8).eval()
    path = tmp_path / "plain.onnx"
    export_module(module, [GraphTensor("x", "float32", ("n", 8))], [GraphTensor("y", "float32", ("n", 8))], {"n": 3},
                  path)
    assert write_tapped_graph(path, tmp_path / ".plain.rounding.onnx") == []
    assert not (tmp_path / ".plain.rounding.onnx").exists()


def test_float16_holds_every_rounded_value_exactly() -> None:
    """The tapped graph returns its roundings as float16 (`write_tapped_graph`); that is lossless only because every
    e4m3 value (saturated at 448, subnormal steps of 2^-9, both zeros) and every e2m1 value is a float16 value."""
    magnitudes = torch.cat([torch.arange(8) * 2.0**-9] + [(8 + torch.arange(8)) * 2.0**(e - 3) for e in range(-6, 9)])
    e4m3 = torch.cat([magnitudes, -magnitudes])
    e4m3 = e4m3[e4m3.abs() <= 448]
    assert graph_ops.round_e4m3(e4m3).equal(e4m3), "these are the e4m3 grid values"
    assert len(set(e4m3.abs().tolist())) == 127  # 0, 7 subnormals, 15 binades x 8 mantissas, less 448's successor
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    for grid in (e4m3, -e4m3, e2m1, -e2m1):
        back = grid.numpy().astype(np.float16).astype(np.float32)
        assert back.tobytes() == grid.numpy().tobytes()  # bit for bit: signs of zero included
    # and a random tensor's roundings survive too
    v = torch.randn(4096) * 100
    rounded = graph_ops.round_e4m3(v.clamp(-448, 448))
    assert torch.from_numpy(rounded.numpy().astype(np.float16).astype(np.float32)).equal(rounded)
