"""TensorRT plugin `mol2::PointerScore` (`tensorrt.plugin`): register (output (B, n) fp32, attribute `heads`: int),
autotune (fp32 tensors, bool option_mask), impl (the two-kernel form on TensorRT's stream) and aot_impl (the
single-kernel form, `pointer_logits_kernel` with FUSED=True, compiled for the build's GPU; see kernel.py).
TensorRT is imported only by `register()`. No `from __future__ import annotations`: `tensorrt.plugin` reads the
decorated functions' annotations as objects.
"""

from typing import Any

from plugins import PLUGIN_NAMESPACE
from plugins.pointer_score.op import OP_TYPE
from plugins.sparse_global_attention.trt import (
    DEFAULT_TARGET,
    AotKernel,
    build_target,
    compile_source,
    constant,
    torch_views,
)
from plugins.tensorrt_support import registration

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
# x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask -> logits
IO_TYPES = ", ".join(["FP32"] * 7 + ["BOOL", "FP32"])


def compile_kernel(target: tuple[int, int] = DEFAULT_TARGET, options: int = 64) -> AotKernel:
    from plugins.pointer_score.kernel import aot_source

    src, config = aot_source(options)
    return compile_source(src, config, target)


def compile_ptx(target: tuple[int, int] = DEFAULT_TARGET, **spec: Any) -> str:
    """PTX of the single-kernel form for `target` (default sm_90, n = 64 options); no TensorRT needed."""
    return compile_kernel(target, **spec).ptx


def _define() -> None:
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def desc(x: trtp.TensorDesc, xn: trtp.TensorDesc, attn_query: trtp.TensorDesc, attn_bias: trtp.TensorDesc,
             point_query: trtp.TensorDesc, point_read: trtp.TensorDesc, point_bias: trtp.TensorDesc,
             option_mask: trtp.TensorDesc, heads: int) -> trtp.TensorDesc:
        return trtp.from_shape_expr((x.shape_expr[0], point_query.shape_expr[1]), dtype=x.dtype)

    @trtp.autotune(PLUGIN_ID)
    def autotune(x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask, outputs):  # type: ignore[no-untyped-def]
        return [trtp.AutoTuneCombination(IO_TYPES, "LINEAR")]

    @trtp.impl(PLUGIN_ID)
    def impl(x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask, heads, outputs, stream):  # type: ignore[no-untyped-def]
        import torch

        from plugins.pointer_score.kernel import launch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            args = torch_views((x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask))
            launch(*args, int(heads), torch_views(outputs)[0])

    @trtp.aot_impl(PLUGIN_ID)
    def aot_impl(x, xn, attn_query, attn_bias, point_query, point_read, point_bias, option_mask, heads, outputs):  # type: ignore[no-untyped-def]
        batch, n = x.shape_expr[0], point_query.shape_expr[1]
        kernel = compile_kernel(build_target(), constant(n, "the option count"))
        params = trtp.KernelLaunchParams()
        params.grid_x = trtp.cdiv(batch, kernel.config.block_b)
        params.block_x = kernel.num_warps * 32
        params.shared_mem = kernel.shared
        dims = (batch, x.shape_expr[1], n, attn_bias.shape_expr[0], int(heads))  # B w n HL heads
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(d) for d in dims])
        return kernel.name.encode(), kernel.ptx.encode(), params, extra


register = registration(PLUGIN_ID, lambda: _define())  # "namespace::name"; registers with TensorRT once
