"""A role's engine component with its weights as the checkpoint stores them: what a bounded engine build exports.

`load_checkpoint(dir, role=...)` dequantizes every tensor into fp32 parameters: right for the reference network,
8x the packed-fp4 bytes for an engine build. `load_stored_role` builds the component on the meta device and fills it
from the memory-mapped shards one tensor at a time, keeping each as stored: fp8 / packed-fp4 projections become
`StoredLinear`s (codes and e8m0 scales as uint8, dequantized where the step reads them), bf16 and f32 tensors keep
their dtype (the steps cast where they read), and the Engram tables are never read (the host feeds their rows,
`engram_feed.EngramFeed`). The component then holds the role's stored bytes and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ced.formats.checkpoint import CheckpointFiles, _audit_names, _check_one, _role_module, role_tensor_names
from ced.formats.config_file import CheckpointError, load_config
from ced.model.config import CEDConfig
from ced.steps.stored_weights import StoredLinear, StoredWeightError, store_linears

QUANTIZED_DTYPES = ("F8_E4M3", "I8", "U8")


def is_engram_table(name: str) -> bool:
    return ".engram.embed." in name


def stores_quantized(directory: str | Path) -> bool:
    """Whether the checkpoint holds fp8 / packed-fp4 weights (the release's storage): the builds that keep them."""
    files = CheckpointFiles(directory)
    return any(t.dtype in QUANTIZED_DTYPES for name, t in files.tensors.items() if not name.endswith(".scale"))


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def load_stored_role(directory: str | Path, role: str) -> tuple[CEDConfig, nn.Module]:
    """(config, the role's component) with every weight as stored; see the module docstring. Reads exactly the role's
    tensors (and their scales) minus the Engram tables; every problem is named in one error."""
    cfg = load_config(directory)
    files = CheckpointFiles(directory)
    _audit_names(files, cfg)
    component = _role_module(cfg, role)  # meta: no bytes yet
    names = set(role_tensor_names(cfg, role))
    quantized = {n for n in names if files.tensors[n].dtype in QUANTIZED_DTYPES and not is_engram_table(n)}

    def stored(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        scale = files.scale_name(name)
        return files.get(name), files.get(scale) if scale in files else None

    try:
        store_linears(component, stored, quantized)
    except StoredWeightError as exc:
        raise CheckpointError(str(exc)) from exc
    left = quantized - {f"{n}.weight" for n, m in component.named_modules() if isinstance(m, StoredLinear)}
    if left:
        raise CheckpointError(f"quantized tensors {sorted(left)[:5]} are not Linear weights; a stored build cannot "
                              "keep them")
    problems = []
    for name, param in list(component.named_parameters()):
        owner, leaf = _owner(component, name)
        if is_engram_table(name):
            owner_path = name.rpartition(".")[0]
            parent, child = _owner(component, owner_path)
            setattr(parent, child, None)  # rows come from the host feed; the table never enters the component
            continue
        tensor = files.get(name)
        problem = _check_one(name, tensor, tuple(param.shape))
        if problem:
            problems.append(problem)
            continue
        setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))
    if problems:
        raise CheckpointError("; ".join(problems))
    return cfg, component.eval()


def stored_bytes(component: nn.Module) -> int:
    """Bytes the component holds (parameters and buffers): the figure a bounded build is measured against."""
    return sum(t.numel() * t.element_size() for t in list(component.parameters()) + list(component.buffers()))
