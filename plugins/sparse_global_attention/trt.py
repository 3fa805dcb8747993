"""TensorRT plugin `mol2::SparseGlobalAttention` (`tensorrt.plugin`, the "quickly deployable plugin" API).

- `register`: shape and type inference (the output is like q) with the ONNX node's attributes `scale` (float)
  and `window` (int; accepted and not needed: the kernel picks each listed row's table itself);
- `autotune`: the type combinations (every float tensor fp32, fp16 or bf16 together; idx int64), linear layout;
- `impl`: the Triton kernel launched on TensorRT's stream through torch views of the TensorRT tensors;
- `aot_impl`: the Triton kernel compiled ahead of time for the build's GPU (`compile_kernel`), returned as
  (kernel name, PTX, launch parameters, symbolic int32 extra args) so an engine runs without Python.

Nothing here imports TensorRT at module level: `register()` does, so this module (and `compile_ptx`, which needs only
Triton) imports anywhere. No `from __future__ import annotations` either: `tensorrt.plugin` reads the annotations of
the decorated functions as objects.
"""

from dataclasses import dataclass, field
from typing import Any

from plugins import PLUGIN_NAMESPACE
from plugins.sparse_global_attention.op import OP_TYPE
from plugins.tensorrt_support import registration

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
FLOATS = "FP32|FP16|BF16"
IO_TYPES = ", ".join([FLOATS, FLOATS, FLOATS, "INT64", FLOATS, FLOATS])  # q, local_kv, global_kv, idx, sink -> out
DEFAULT_TARGET = (90, 32)  # sm_90 (H100 / H200), 32 threads a warp


@dataclass(frozen=True)
class AotKernel:
    """One ahead-of-time compiled Triton kernel: what TensorRT needs to launch it."""

    name: str
    ptx: str
    num_warps: int
    shared: int  # bytes of dynamic shared memory
    config: Any  # the kernel's block sizes (its module's Config)
    compiled: Any = field(default=None, repr=False, compare=False)  # triton's CompiledKernel (launchable on a GPU)


def compile_source(src: Any, config: Any, target: tuple[int, int] = DEFAULT_TARGET) -> AotKernel:
    """triton.compile for a CUDA target (compute capability as an int, warp size); works without a GPU.

    TensorRT launches the kernel with exactly its declared arguments, so the compiled kernel must not need the global
    or profiling scratch buffers recent Triton versions pass as hidden trailing pointers."""
    import triton
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", int(target[0]), int(target[1])), options=options)
    meta = compiled.metadata
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(meta, scratch, 0):
            raise RuntimeError(f"{meta.name} needs {scratch}={getattr(meta, scratch)}: TensorRT's AOT launch cannot "
                               f"provide it")
    return AotKernel(meta.name, compiled.asm["ptx"], meta.num_warps, meta.shared, config, compiled)


def compile_kernel(target: tuple[int, int] = DEFAULT_TARGET, dtype: str = "fp32", heads: int = 64, head_dim: int = 512,
                   scale: float | None = None) -> AotKernel:
    from plugins.sparse_global_attention.kernel import aot_source

    src, config = aot_source(dtype, heads, head_dim, scale)
    return compile_source(src, config, target)


def compile_ptx(target: tuple[int, int] = DEFAULT_TARGET, **spec: Any) -> str:
    """PTX of the kernel for `target` (default sm_90, fp32, 64 heads, D = 512, scale D**-0.5); no TensorRT needed."""
    return compile_kernel(target, **spec).ptx


def build_target() -> tuple[int, int]:
    """The GPU this process builds for (TensorRT builds on the GPU it targets), else sm_90."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor, 32
    except Exception:  # noqa: BLE001 - no usable CUDA: fall back to the default target
        pass
    return DEFAULT_TARGET


def triton_dtype(trt_dtype: Any) -> str:
    import tensorrt as trt

    names = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}
    if trt_dtype not in names:
        raise ValueError(f"unsupported TensorRT data type {trt_dtype}")
    return names[trt_dtype]


def constant(expr: Any, what: str) -> int:
    """A build-time constant dimension (head count, head dim, option count select the kernel's blocks)."""
    if not expr.is_constant:
        raise ValueError(f"{PLUGIN_NAMESPACE} AOT kernels need {what} fixed at build time (a static dimension)")
    return int(expr.constant_value())


def torch_views(tensors: Any) -> list:  # type: ignore[type-arg]
    """Zero-copy torch tensors over TensorRT tensors (the CUDA array interface), as the public QDP samples do."""
    import torch

    return [torch.as_tensor(t, device="cuda") for t in tensors]


def _define() -> None:
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def desc(q: trtp.TensorDesc, local_kv: trtp.TensorDesc, global_kv: trtp.TensorDesc, idx: trtp.TensorDesc,
             sink: trtp.TensorDesc, scale: float, window: int) -> trtp.TensorDesc:
        return q.like()

    @trtp.autotune(PLUGIN_ID)
    def autotune(q, local_kv, global_kv, idx, sink, outputs):  # type: ignore[no-untyped-def]
        return [trtp.AutoTuneCombination(IO_TYPES, "LINEAR")]

    @trtp.impl(PLUGIN_ID)
    def impl(q, local_kv, global_kv, idx, sink, scale, window, outputs, stream):  # type: ignore[no-untyped-def]
        # window: the kernel picks each row's table itself (kernel.py), so the attribute only has to be accepted
        import torch

        from plugins.sparse_global_attention.kernel import launch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            args = torch_views((q, local_kv, global_kv, idx, sink))
            launch(*args, float(scale), torch_views(outputs)[0])

    @trtp.aot_impl(PLUGIN_ID)
    def aot_impl(q, local_kv, global_kv, idx, sink, scale, window, outputs):  # type: ignore[no-untyped-def]
        qs = q.shape_expr
        heads, head_dim = constant(qs[2], "the head count"), constant(qs[3], "the head dimension")
        kernel = compile_kernel(build_target(), triton_dtype(q.dtype), heads, head_dim, float(scale))
        params = trtp.KernelLaunchParams()
        params.grid_x = trtp.cdiv(qs[2], kernel.config.block_h)
        params.grid_y = qs[0] * qs[1]
        params.block_x = kernel.num_warps * 32
        params.shared_mem = kernel.shared
        # S H D Tl Tg J
        dims = (qs[1], qs[2], qs[3], local_kv.shape_expr[1], global_kv.shape_expr[1], idx.shape_expr[2])
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(d) for d in dims])
        return kernel.name.encode(), kernel.ptx.encode(), params, extra


register = registration(PLUGIN_ID, lambda: _define())  # "namespace::name"; registers with TensorRT once
