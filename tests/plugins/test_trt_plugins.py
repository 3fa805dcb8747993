"""The three mol2 ops as TensorRT plugins (`tensorrt.plugin`): registration, attributes, shape inference, and (with a
GPU) an engine per op against the reference, through the Python `impl` and the ahead-of-time kernel.

Everything here needs TensorRT with its plugin API; without it every test is skipped with the reason
`plugins.tensorrt_support.tensorrt_missing_reason()` gives. The CPU-side part of `aot_impl` (the Triton compile to
sm_90 PTX) is tested without TensorRT in test_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

import plugins
from plugins.tensorrt_support import tensorrt_missing_reason

EXPECTED = [f"{plugins.PLUGIN_NAMESPACE}::{op}" for op in plugins.OPS]
ATTRIBUTES = {"SparseGlobalAttention": {"scale": float, "window": int}, "SwaReplayAttention": {"scale": float},
              "PointerScore": {"heads": int}}


@pytest.fixture(scope="module")
def trt():  # type: ignore[no-untyped-def]
    reason = tensorrt_missing_reason()
    if reason is not None:
        pytest.skip(f"TensorRT plugin API unavailable: {reason}")
    import tensorrt

    return tensorrt


@pytest.fixture(scope="module")
def registered(trt):  # type: ignore[no-untyped-def]
    return plugins.register_all()


def test_register_all_registers_every_op(trt, registered) -> None:  # type: ignore[no-untyped-def]
    assert registered == EXPECTED
    assert plugins.register_all() == EXPECTED, "registering twice is harmless"
    registry = trt.get_plugin_registry()
    for op in plugins.OPS:
        creator = registry.get_creator(op, plugins.PLUGIN_VERSION, plugins.PLUGIN_NAMESPACE)
        assert creator is not None, (
            f"no creator for {op} v{plugins.PLUGIN_VERSION} in namespace {plugins.PLUGIN_NAMESPACE}")


def test_plugin_fields_match_the_onnx_attributes(trt, registered) -> None:  # type: ignore[no-untyped-def]
    """TensorRT's ONNX parser fills plugin fields from node attributes of the same name (and type)."""
    import onnx

    plugins.register_onnx_schemas()
    kinds = {float: {trt.PluginFieldType.FLOAT32, trt.PluginFieldType.FLOAT64},
             int: {trt.PluginFieldType.INT32, trt.PluginFieldType.INT64}}
    for op, wanted in ATTRIBUTES.items():
        schema = onnx.defs.get_schema(op, plugins.OPSET_VERSION, plugins.DOMAIN)
        assert set(schema.attributes) == set(wanted), f"{op}: the ONNX schema's attributes changed"
        creator = trt.get_plugin_registry().get_creator(op, plugins.PLUGIN_VERSION, plugins.PLUGIN_NAMESPACE)
        fields = {f.name: f.type for f in creator.field_names}
        for name, kind in wanted.items():
            assert name in fields, f"{op}: plugin field {name!r} missing (has {sorted(fields)})"
            assert fields[name] in kinds[kind], f"{op}: field {name!r} has type {fields[name]}"


def _network(trt):  # type: ignore[no-untyped-def]
    try:
        builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    except Exception as exc:  # noqa: BLE001 - TensorRT's builder needs a GPU
        pytest.skip(f"TensorRT's builder is unavailable here ({type(exc).__name__}: {exc})")
    if builder is None:
        pytest.skip("TensorRT's builder is unavailable here (no GPU)")
    return builder, builder.create_network(0)


CASES = {  # op -> input (name, shape, TensorRT type name), attributes, output shape
    "SparseGlobalAttention": ([("q", (2, 3, 8, 64), "FLOAT"), ("local_kv", (2, 40, 64), "FLOAT"),
                               ("global_kv", (2, 300, 64), "FLOAT"), ("idx", (2, 3, 96), "INT64"),
                               ("sink", (8,), "FLOAT")], {"scale": 0.125, "window": 0}, (2, 3, 8, 64)),
    "SwaReplayAttention": ([("q", (2, 5, 8, 64), "FLOAT"), ("kv", (2, 133, 64), "FLOAT"), ("idx", (2, 5, 128), "INT64"),
                            ("sink", (8,), "FLOAT")], {"scale": 0.125}, (2, 5, 8, 64)),
    "PointerScore": ([("x", (3, 64), "FLOAT"), ("xn", (3, 64), "FLOAT"), ("attn_query", (64, 4 * 6 * 5), "FLOAT"),
                      ("attn_bias", (4 * 6 * 5,), "FLOAT"), ("point_query", (64, 6), "FLOAT"),
                      ("point_read", (4 * 6 * 5, 6), "FLOAT"),
                      ("point_bias", (6,), "FLOAT"), ("option_mask", (3, 6), "BOOL")], {"heads": 4}, (3, 6)),
}


def _add_op(trt, network, op: str, aot: bool = False):  # type: ignore[no-untyped-def]
    import tensorrt.plugin as trtp

    inputs, attrs, _ = CASES[op]
    tensors = [network.add_input(name, getattr(trt.DataType, kind), shape) for name, shape, kind in inputs]
    spec = getattr(getattr(trtp.op, plugins.PLUGIN_NAMESPACE), op)(*tensors, **attrs)
    layer = network.add_plugin(spec, aot=aot) if aot else network.add_plugin(spec)
    out = layer.get_output(0)
    out.name = "out"
    network.mark_output(out)
    return out


@pytest.mark.parametrize("op", list(CASES))
def test_shape_and_type_inference(trt, registered, op: str) -> None:  # type: ignore[no-untyped-def]
    _, network = _network(trt)
    out = _add_op(trt, network, op)
    assert tuple(out.shape) == CASES[op][2]
    assert out.dtype == trt.DataType.FLOAT


def _inputs(op: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inputs, _, _ = CASES[op]
    out = {}
    for name, shape, kind in inputs:
        if kind == "FLOAT":
            out[name] = torch.randn(shape, generator=g)
        elif kind == "BOOL":
            out[name] = torch.rand(shape, generator=g) < 0.7
        else:  # the index list, after the key tables it points into
            rows = sum(out[t].shape[1] for t in ("local_kv", "global_kv", "kv") if t in out)
            idx = torch.randint(0, rows, shape, generator=g)
            idx[torch.rand(shape, generator=g) < 0.3] = -1
            out[name] = idx
    return out


def _reference(op: str, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    from plugins.pointer_score.reference import pointer_score_reference
    from plugins.sparse_global_attention.reference import sparse_global_attention_reference
    from plugins.swa_replay_attention.reference import swa_replay_attention_reference

    attrs = CASES[op][1]
    if op == "SparseGlobalAttention":
        return sparse_global_attention_reference(*feed.values(), attrs["scale"], attrs["window"])
    if op == "SwaReplayAttention":
        return swa_replay_attention_reference(*feed.values(), attrs["scale"])
    return pointer_score_reference(*feed.values(), attrs["heads"])


@pytest.mark.gpu
@pytest.mark.parametrize("aot", [False, True], ids=["impl", "aot"])
@pytest.mark.parametrize("op", list(CASES))
def test_engine_matches_reference(trt, registered, op: str, aot: bool, seed: int) -> None:  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: TensorRT builds and runs engines on an NVIDIA GPU only")
    builder, network = _network(trt)
    _add_op(trt, network, op, aot)
    plan = builder.build_serialized_network(network, builder.create_builder_config())
    assert plan is not None, "the engine build failed"
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    feed = _inputs(op, seed)
    on_gpu = {k: v.cuda() for k, v in feed.items()}
    out = torch.full(CASES[op][2], float("nan"), device="cuda")
    for name, tensor in on_gpu.items():
        context.set_tensor_address(name, tensor.data_ptr())
    context.set_tensor_address("out", out.data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    want = _reference(op, feed)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(out.cpu()), torch.isinf(want))
    assert (out.cpu()[fin] - want[fin]).abs().max() < 1e-4
