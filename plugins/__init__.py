"""Custom ops of the CED network, one folder per op, each with the same parts:

- `reference.py`: the PyTorch definition (what the network itself calls on CPU: the one source of truth),
- `op.py`: the `torch.library` op (reference on CPU, the OpenAI Triton kernel on CUDA) and the call that becomes one
  `mol2` node while exporting,
- `onnx.py`: the ONNX schema and the local function made of standard ops (onnxruntime inlines it; TensorRT's parser
  maps the node to the plugin),
- `kernel.py`: the OpenAI Triton kernel, `trt.py`: the TensorRT plugin (`tensorrt.plugin`, guarded import).

The domain, namespace, op names and versions live here, once.
"""

from __future__ import annotations

DOMAIN = "mol2"
PLUGIN_NAMESPACE = "mol2"
PLUGIN_VERSION = "1"
OPSET_VERSION = 1  # version of the `mol2` opset the graphs import
OPS = {  # ONNX op_type -> plugin folder
    "SparseGlobalAttention": "sparse_global_attention",
    "SwaReplayAttention": "swa_replay_attention",
    "PointerScore": "pointer_score",
}


AOT = 1  # TensorRT's parser uses a plugin's ahead-of-time kernel (PTX, no Python at run time) for nodes with aot=1


def plugin_attributes() -> dict[str, str | int]:
    """The attributes every `mol2` node carries so TensorRT's ONNX parser finds the registered plugin and uses its
    ahead-of-time implementation (the Triton kernel compiled to PTX at build time) rather than the Python one."""
    return {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION, "aot": AOT}


def onnx_functions(opset: int):  # type: ignore[no-untyped-def]
    """The local functions (FunctionProto) of every op, for a model importing the standard domain at `opset`."""
    import importlib

    return [importlib.import_module(f"plugins.{folder}.onnx").function(opset) for folder in OPS.values()]


def register_onnx_schemas() -> None:
    """Register every op's OpSchema with onnx (idempotent), so onnx.checker and shape inference know them."""
    import importlib

    for folder in OPS.values():
        importlib.import_module(f"plugins.{folder}.onnx").register_schema()


def register_all() -> list[str]:
    """Register every op as a TensorRT plugin (`tensorrt.plugin`); raises `TensorRTUnavailable` without TensorRT.

    Used by the `--format trt` build and the TensorRT runtime. Returns the registered `namespace::name` ids.
    """
    import importlib

    from plugins.tensorrt_support import require_tensorrt_plugin

    require_tensorrt_plugin()
    return [importlib.import_module(f"plugins.{folder}.trt").register() for folder in OPS.values()]
