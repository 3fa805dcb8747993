"""How each op reaches the network: a `torch.library` op in eager mode, one `mol2` node while exporting to ONNX.

The `torch.library` op runs the reference on CPU and the op's OpenAI Triton kernel on CUDA (falling back to the
reference where Triton is missing). Calls that need gradients (training) run the reference directly: it is plain
differentiable torch. While `torch.onnx.export` traces, `torch.onnx.ops.symbolic` records one node of domain `mol2`
carrying the op's attributes plus `plugin_namespace` / `plugin_version`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from plugins import OPSET_VERSION, plugin_attributes


def exporting() -> bool:
    return torch.onnx.is_in_onnx_export()


def symbolic(op_type: str, inputs: Sequence[torch.Tensor], attrs: dict[str, object], like: torch.Tensor,
             shape: Sequence[object] | None = None) -> torch.Tensor:
    """One `mol2::<op_type>` node with the output's dtype of `like` and the given (symbolic) shape."""
    return torch.onnx.ops.symbolic(
        f"mol2::{op_type}", tuple(inputs), attrs={**attrs, **plugin_attributes()}, dtype=like.dtype,
        shape=tuple(like.shape if shape is None else shape), version=OPSET_VERSION,
    )


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def cuda_kernel_or_reference(kernel_module: str, kernel_name: str,
                             reference: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The CUDA implementation of an op: its Triton kernel when `triton` imports, else the reference."""

    def run(*args: object) -> torch.Tensor:
        try:
            import importlib

            kernel = getattr(importlib.import_module(kernel_module), kernel_name)
        except ImportError:
            return reference(*args)
        return kernel(*args)

    return run
