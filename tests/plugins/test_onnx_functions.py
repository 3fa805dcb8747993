"""Each mol2 op's ONNX local function, run by onnxruntime, against its PyTorch reference (fresh random inputs)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from plugins import DOMAIN, OPSET_VERSION, onnx_functions, plugin_attributes, register_onnx_schemas
from plugins.pointer_score.reference import pointer_score_reference
from plugins.sparse_global_attention.reference import sparse_global_attention_reference
from plugins.swa_replay_attention.reference import swa_replay_attention_reference

OPSET = 18


def _run_single_node(op_type: str, inputs: dict[str, np.ndarray], attrs: dict[str, object],
                     out_dims: int) -> np.ndarray:
    """A model with one mol2 node and the local functions; onnx.checker, then onnxruntime on CPU."""
    dtype = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
             np.dtype(np.bool_): TensorProto.BOOL}
    graph_inputs = [helper.make_tensor_value_info(k, dtype[v.dtype], list(v.shape)) for k, v in inputs.items()]
    node = helper.make_node(op_type, list(inputs), ["out"], domain=DOMAIN, **attrs, **plugin_attributes())
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [None] * out_dims)
    model = helper.make_model(helper.make_graph([node], "g", graph_inputs, [out]),
                              opset_imports=[helper.make_opsetid("", OPSET),
                                             helper.make_opsetid(DOMAIN, OPSET_VERSION)],
                              functions=onnx_functions(OPSET))
    register_onnx_schemas()
    onnx.checker.check_model(model, full_check=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


def _index_lists(B: int, S: int, J: int, rows: int, masked: float, generator: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, rows, (B, S, J), generator=generator)
    idx[torch.rand(B, S, J, generator=generator) < masked] = -1
    idx[0, 0] = -1  # one query sees nothing: the sink takes all the mass, the output is zero
    return idx


@pytest.mark.parametrize("window", [0, 6, 14])
def test_sparse_global_attention_function_matches_reference(seed: int, window: int) -> None:
    """`window` leading entries come from local_kv alone, the rest from either table (window 14: the whole list)."""
    g = torch.Generator().manual_seed(seed)
    B, S, H, D, Tl, Tg, J = 3, 5, 4, 16, 9, 37, 14
    q, local_kv, global_kv = (torch.randn(B, S, H, D, generator=g), torch.randn(B, Tl, D, generator=g),
                              torch.randn(B, Tg, D, generator=g))
    idx, sink = _index_lists(B, S, J, Tl + Tg, 0.3, g), torch.randn(H, generator=g)
    idx[..., :window] = torch.where(idx[..., :window] < 0, idx[..., :window], idx[..., :window] % Tl)  # the contract
    want = sparse_global_attention_reference(q, local_kv, global_kv, idx, sink, D ** -0.5, window)
    inputs = {"q": q, "local_kv": local_kv, "global_kv": global_kv, "idx": idx, "sink": sink}
    got = _run_single_node("SparseGlobalAttention", {k: v.numpy() for k, v in inputs.items()},
                           {"scale": D ** -0.5, "window": window}, 4)
    assert np.abs(got - want.numpy()).max() < 1e-5
    assert np.all(got[0, 0] == 0), "a query with no valid key returns zeros"
    if window < J:
        assert (idx >= Tl).any() and (idx[..., window:] < Tl).any(), "both tables were read after the window"


def test_sparse_global_attention_reference_refuses_a_list_that_breaks_the_window() -> None:
    from plugins.sparse_global_attention.reference import check_window

    idx = torch.tensor([[[0, 3, -1, 20]]])
    check_window(idx, local_rows=4, window=3)  # rows 0, 3 and none: within the local table
    with pytest.raises(ValueError, match="first 4 entries"):
        check_window(idx, local_rows=4, window=4)  # row 20 is a global entry
    with pytest.raises(ValueError, match="window must lie in"):
        check_window(idx, local_rows=4, window=5)


def test_swa_replay_attention_function_matches_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    B, S, H, D, T, W = 2, 7, 4, 16, 23, 8
    q, kv, sink = torch.randn(B, S, H, D, generator=g), torch.randn(B, T, D, generator=g), torch.randn(H, generator=g)
    idx = _index_lists(B, S, W, T, 0.25, g)
    want = swa_replay_attention_reference(q, kv, idx, sink, D ** -0.5)
    got = _run_single_node("SwaReplayAttention", {"q": q.numpy(), "kv": kv.numpy(), "idx": idx.numpy(),
                                                  "sink": sink.numpy()}, {"scale": D ** -0.5}, 4)
    assert np.abs(got - want.numpy()).max() < 1e-5 and np.all(got[0, 0] == 0)


def test_pointer_score_function_matches_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    B, w, heads, n, T = 5, 12, 4, 3, 6
    HL = heads * n * T
    x, xn = torch.randn(B, w, generator=g), torch.randn(B, w, generator=g)
    attn_query, attn_bias = torch.randn(w, HL, generator=g), torch.randn(HL, generator=g)
    attn_bias[:T // 2] = float("-inf")  # padding of the first option's tokens
    point_query, point_read, point_bias = (torch.randn(w, n, generator=g), torch.randn(HL, n, generator=g),
                                           torch.randn(n, generator=g))
    mask = torch.rand(B, n, generator=g) < 0.7
    mask[:, 0] = True
    args = (x, xn, attn_query, attn_bias, point_query, point_read, point_bias, mask)
    want = pointer_score_reference(*args, heads)
    names = ("x", "xn", "attn_query", "attn_bias", "point_query", "point_read", "point_bias", "option_mask")
    got = _run_single_node("PointerScore", {k: v.numpy() for k, v in zip(names, args)}, {"heads": heads}, 2)
    finite = torch.isfinite(want).numpy()
    assert np.array_equal(finite, np.isfinite(got)), "the same options are excluded"
    assert np.abs(got[finite] - want.numpy()[finite]).max() < 1e-4
