"""TensorRT plugin `mol2::SwaReplayAttention` (`tensorrt.plugin`); same structure as the SparseGlobalAttention plugin
(plugins/sparse_global_attention/trt.py): register (output like q, attribute `scale`: float), autotune, impl on
TensorRT's stream, aot_impl with the kernel compiled for the build's GPU. TensorRT is imported only by `register()`.
No `from __future__ import annotations`: `tensorrt.plugin` reads the decorated functions' annotations as objects.
"""

from typing import Any

from plugins import PLUGIN_NAMESPACE
from plugins.sparse_global_attention.trt import (
    DEFAULT_TARGET,
    FLOATS,
    AotKernel,
    build_target,
    compile_source,
    constant,
    torch_views,
    triton_dtype,
)
from plugins.swa_replay_attention.op import OP_TYPE
from plugins.tensorrt_support import registration

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
IO_TYPES = ", ".join([FLOATS, FLOATS, "INT64", FLOATS, FLOATS])  # q, kv, idx, sink -> out


def compile_kernel(target: tuple[int, int] = DEFAULT_TARGET, dtype: str = "fp32", heads: int = 64, head_dim: int = 512,
                   scale: float | None = None) -> AotKernel:
    from plugins.swa_replay_attention.kernel import aot_source

    src, config = aot_source(dtype, heads, head_dim, scale)
    return compile_source(src, config, target)


def compile_ptx(target: tuple[int, int] = DEFAULT_TARGET, **spec: Any) -> str:
    """PTX of the kernel for `target` (default sm_90, fp32, 64 heads, D = 512, scale D**-0.5); no TensorRT needed."""
    return compile_kernel(target, **spec).ptx


def _define() -> None:
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def desc(q: trtp.TensorDesc, kv: trtp.TensorDesc, idx: trtp.TensorDesc, sink: trtp.TensorDesc,
             scale: float) -> trtp.TensorDesc:
        return q.like()

    @trtp.autotune(PLUGIN_ID)
    def autotune(q, kv, idx, sink, outputs):  # type: ignore[no-untyped-def]
        return [trtp.AutoTuneCombination(IO_TYPES, "LINEAR")]

    @trtp.impl(PLUGIN_ID)
    def impl(q, kv, idx, sink, scale, outputs, stream):  # type: ignore[no-untyped-def]
        import torch

        from plugins.swa_replay_attention.kernel import launch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            launch(*torch_views((q, kv, idx, sink)), float(scale), torch_views(outputs)[0])

    @trtp.aot_impl(PLUGIN_ID)
    def aot_impl(q, kv, idx, sink, scale, outputs):  # type: ignore[no-untyped-def]
        qs = q.shape_expr
        heads, head_dim = constant(qs[2], "the head count"), constant(qs[3], "the head dimension")
        kernel = compile_kernel(build_target(), triton_dtype(q.dtype), heads, head_dim, float(scale))
        params = trtp.KernelLaunchParams()
        params.grid_x = trtp.cdiv(qs[2], kernel.config.block_h)
        params.grid_y = qs[0] * qs[1]
        params.block_x = kernel.num_warps * 32
        params.shared_mem = kernel.shared
        dims = (qs[1], qs[2], qs[3], kv.shape_expr[1], idx.shape_expr[2])  # S H D T J
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(d) for d in dims])
        return kernel.name.encode(), kernel.ptx.encode(), params, extra


register = registration(PLUGIN_ID, lambda: _define())  # "namespace::name"; registers with TensorRT once
