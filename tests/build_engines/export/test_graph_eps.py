"""The norms' eps survive export: onnxscript's optimizer drops an Add of a scalar it takes for zero (|c| < 1e-8), and
the release's norm_eps is 1e-20, so an all-zero row (a replay's padding) must still normalise to 0, not 0 / 0."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch

from ced.steps.graph_ops import plus_eps, rms_norm
from ced.steps.opset import OPSET


class _Norms(torch.nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, None, self.eps), torch.rsqrt(plus_eps(x.square().mean(-1), self.eps))


@pytest.mark.parametrize("eps", [1e-20, 1e-6])
def test_a_zero_row_normalises_to_zero_in_the_optimized_graph(eps: float) -> None:
    x = torch.zeros(3, 16)
    x[1] = torch.randn(16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(_Norms(eps), (x,), dynamo=True, opset_version=OPSET, optimize=True, verbose=False)
    model = program.model_proto
    assert "Add" in [n.op_type for n in model.graph.node], "the eps Add was optimized away"
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    want = _Norms(eps)(x)
    assert np.isfinite(got[0]).all() and (got[0][[0, 2]] == 0).all()
    np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-6, atol=1e-7)
    assert np.isfinite(got[1][1]) and got[1][0] == np.float32(want[1][0].item())
    assert torch.equal(plus_eps(x, eps), x + eps), "bit for bit the scalar sum"
