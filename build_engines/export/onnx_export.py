"""Export the step modules to ONNX: one graph per component, the `mol2` ops as nodes backed by local functions.

Exporter: `torch.onnx.export(..., dynamo=True)` (torch.export + onnxscript) at opset 18, with dynamic batch,
step length and store lengths. Each `mol2` op becomes one node (`torch.onnx.ops.symbolic`, see plugins/op_wrapper.py)
and the model carries the ops' FunctionProtos, so onnxruntime inlines them and TensorRT's parser can map the nodes
to plugins. Graph inputs and outputs are named by `StepLayout`, in its order.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from pathlib import Path

import onnx
import torch
from torch.export import Dim

from ced.steps.layout import GraphTensor, StepLayout
from ced.steps.opset import OPSET
from plugins import DOMAIN, OPSET_VERSION, onnx_functions, register_onnx_schemas

_DTYPES = {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool}
# the exporter's op registry warns once per torchvision op it skips when torchvision is not installed (it is not: the
# graphs use none of its ops), a screenful on every build; its other warnings stay
logging.getLogger("torch.onnx._internal.exporter._registration").addFilter(
    lambda record: not record.getMessage().startswith("torchvision is not installed"))


def example(tensors: list[GraphTensor], sizes: dict[str, int]) -> tuple[torch.Tensor, ...]:
    """Example inputs of the given sizes (zeros; int64 zeros are valid positions and slots)."""
    return tuple(torch.zeros(t.shape_for(sizes), dtype=_DTYPES[t.dtype]) for t in tensors)


def dynamic_shapes(module: torch.nn.Module, tensors: list[GraphTensor]) -> tuple[object, ...]:
    """One spec per forward parameter; the tensors of a `*args` parameter are grouped in one tuple, as torch.export
    sees them."""
    dims: dict[str, Dim] = {}
    specs = []
    for t in tensors:
        spec = {i: dims.setdefault(d, Dim(d, min=1)) for i, d in enumerate(t.dims) if isinstance(d, str)}
        specs.append(spec or None)
    fixed = [p for p in inspect.signature(module.forward).parameters.values() if p.kind != p.VAR_POSITIONAL]
    if len(fixed) == len(specs):
        return tuple(specs)
    return (*specs[:len(fixed)], tuple(specs[len(fixed):]))


def export_module(module: torch.nn.Module, inputs: list[GraphTensor], outputs: list[GraphTensor], sizes: dict[str, int],
                  path: Path, external_data: bool = False) -> onnx.ModelProto:
    """Trace `module` on example inputs, attach the mol2 functions, name the I/O, check, and save to `path`.

    `external_data`: write the weights to `<path>.data`, one tensor at a time, and return the graph without them.
    Why: serializing the whole model (`model_proto`, then `onnx.save`) holds two more copies of every weight in
    memory; a bounded build (stored weights) must hold one. The graph file then references the data file by its
    name, so the two move together."""
    args = example(inputs, sizes)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, dynamo=True, opset_version=OPSET, dynamic_shapes=dynamic_shapes(module, inputs),
            input_names=[t.name for t in inputs], output_names=[t.name for t in outputs], optimize=False,
            verbose=False,
        )
    optimize_graph(program.model, keep_stored=external_data)
    for value, tensor in zip(program.model.graph.outputs, outputs):  # as the exporter names them after its optimizer:
        value.name = tensor.name  # merged duplicates get an Identity of their own (OutputFixPass), named here
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data:
        return _save_with_external_data(program.model, path)
    model = program.model_proto
    model = attach_functions(model)
    register_onnx_schemas()
    onnx.checker.check_model(model, full_check=False)
    onnx.save(model, str(path))
    return model


def keep_stored_weights(node: "onnx_ir.Node") -> bool | None:  # noqa: F821
    """The optimizer's folding rule for graphs of stored weights: never fold a node that reads uint8 (fp8 codes,
    packed fp4, e8m0 scales) or bf16, so a dequantization stays in the graph instead of becoming an fp32 copy of the
    weight (4-8x its bytes); everything else as the optimizer decides."""
    import onnx_ir

    keep = (onnx_ir.DataType.UINT8, onnx_ir.DataType.BFLOAT16)
    return False if any(v is not None and v.dtype in keep for v in node.inputs) else None


def _default_folding(node: "onnx_ir.Node") -> None:  # noqa: F821
    """Every node as the optimizer's own folding rules decide."""
    return None


def optimize_graph(model: "onnx_ir.Model", keep_stored: bool = False) -> None:  # noqa: F821
    """onnxscript's `optimize_ir` without its pattern rewriter: inlining, constant folding, dead-node removal,
    constant lifting, initializer deduplication and common-subexpression elimination all run.

    Why no rewriter: its matcher is quadratic in the graph's size. On the 40-layer release-shaped graphs it took over
    20 minutes per graph on a 2-core machine, and on the tiny 8-layer test network it is a fifth of each graph's
    export (7 of 44 s for the decoder) for 3% fewer nodes, fusions that onnxruntime and TensorRT make themselves when
    they load the graph. `keep_stored`: graphs of stored weights (fp8 codes, packed fp4, e8m0 scales, bf16) keep their
    dequantizations instead of folding them into fp32 copies of the weights (`keep_stored_weights`, 4-8x the bytes)."""
    import onnx_ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer import fold_constants_ir

    onnx_ir.passes.Sequential(common.InlinePass())(model)
    should_fold = keep_stored_weights if keep_stored else _default_folding
    for _ in range(2):
        fold_constants_ir(model, onnx_shape_inference=True, should_fold=should_fold)
        common.RemoveUnusedNodesPass()(model)
    onnx_ir.passes.Sequential(
        common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(), common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(), common.OutputFixPass(), common.NameFixPass(),
    )(model)


def data_file(path: Path) -> Path:
    """Where a graph's external weights live (`encoder.onnx` -> `encoder.onnx.data`)."""
    return path.with_name(path.name + ".data")


def _save_with_external_data(model: "onnx_ir.Model", path: Path) -> onnx.ModelProto:  # noqa: F821
    import onnx_ir

    data = data_file(path)
    data.unlink(missing_ok=True)
    onnx_ir.save(model, path, external_data=data.name)
    proto = attach_functions(_shapes_inline(onnx.load(str(path), load_external_data=False), data))
    onnx.save(proto, str(path))  # the weights stay where they are: only the graph is rewritten
    register_onnx_schemas()
    onnx.checker.check_model(str(path), full_check=False)
    return proto


def _shapes_inline(model: onnx.ModelProto, data: Path) -> onnx.ModelProto:
    """Move int64 initializers (shapes, split sizes, indices: never weights) from the data file back into the graph.

    Why: onnxruntime's shape inference reads a Split's sizes (and other shape inputs) only from inline data, and the
    writer sends every tensor over 256 bytes out: the 49 sizes of a 48-expert up-projection (one expert per chunk)
    made the graph fail to load ("Cannot parse data from external tensors"); the release's 256 experts would too.
    Their bytes stay behind in the data file, unreferenced (a few KB)."""
    with open(data, "rb") as stored:
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL or t.data_type != onnx.TensorProto.INT64:
                continue
            where = {e.key: e.value for e in t.external_data}
            stored.seek(int(where.get("offset", 0)))
            t.raw_data = stored.read(int(where["length"]))
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
    return model


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the mol2 FunctionProtos (once) and make sure the model imports the mol2 opset."""
    used = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    have = {(f.domain, f.name) for f in model.functions}
    for f in onnx_functions(OPSET):
        if f.name in used and (f.domain, f.name) not in have:
            model.functions.append(f)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, OPSET_VERSION))
    return model


def export_sizes(layout: StepLayout) -> dict[str, int]:
    """Example sizes for tracing: distinct values so the exporter cannot confuse two dynamic dims."""
    sizes = {"B": 2, "S": 3, "A": 3, "R": 4, "U": 5, "C": 7, "HL": 24, "n": 3, "K": 11}
    for i, s in enumerate(layout.sources):
        sizes[f"N_{s}"] = layout.padded_entries(1) * (i + 2)
    return sizes
