"""Small helpers for writing the ops' ONNX schemas and local functions with `onnx.helper` (no exporter involved)."""

from __future__ import annotations

from typing import Sequence

import onnx
from onnx import AttributeProto, helper

from plugins import AOT, DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION

PLUGIN_ATTRIBUTES = ("plugin_namespace", "plugin_version", "aot")


class FunctionBuilder:
    """Collects the nodes of one FunctionProto; `op(...)` adds a node and returns its output name(s)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs: object) -> str | list[str]:
        names = [f"{op_type.lower()}_{self._count}_{i}" for i in range(outputs)]
        self._count += 1
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else names

    def const(self, value: object, dtype: int = onnx.TensorProto.INT64) -> str:
        """A constant tensor (int64 by default); lists become 1-D tensors, scalars 0-D."""
        dims = [len(value)] if isinstance(value, (list, tuple)) else []
        vals = list(value) if isinstance(value, (list, tuple)) else [value]
        return self.op("Constant", value=helper.make_tensor(f"c{self._count}", dtype, dims, vals))  # type: ignore[return-value]

    def attr_const(self, attribute: str, kind: int = AttributeProto.FLOAT) -> str:
        """A Constant node whose value is the calling node's attribute `attribute` (ref_attr_name)."""
        name = f"attr_{attribute}_{self._count}"
        self._count += 1
        node = helper.make_node("Constant", [], [name])
        field = {AttributeProto.FLOAT: "value_float", AttributeProto.INT: "value_int"}[kind]
        node.attribute.append(AttributeProto(name=field, ref_attr_name=attribute, type=kind))
        self.nodes.append(node)
        return name

    def rename_output(self, produced: str, wanted: str) -> None:
        """Make the last node that produced `produced` write `wanted` instead (function outputs need fixed names)."""
        for node in reversed(self.nodes):
            for i, out in enumerate(node.output):
                if out == produced:
                    node.output[i] = wanted
                    return
        raise KeyError(produced)

    def function(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], attributes: Sequence[str],
                 opset: int) -> onnx.FunctionProto:
        return helper.make_function(
            DOMAIN, op_type, list(inputs), list(outputs), self.nodes, [helper.make_opsetid("", opset)],
            attributes=list(attributes) + list(PLUGIN_ATTRIBUTES),
        )


def schema(op_type: str, doc: str, inputs: Sequence[tuple[str, str, str]], outputs: Sequence[tuple[str, str, str]],
           attributes: Sequence[tuple[str, int, str]],
           type_constraints: Sequence[tuple[str, Sequence[str], str]]) -> onnx.defs.OpSchema:
    """An OpSchema in domain mol2: (name, type_str, description) per input/output, (name, AttrType, doc) per
    attribute."""
    OpSchema = onnx.defs.OpSchema
    attrs = [OpSchema.Attribute(name, kind, description, required=True) for name, kind, description in attributes]
    attrs += [OpSchema.Attribute(name, helper.make_attribute(name, value), f"TensorRT plugin lookup ({name})")
              for name, value in (("plugin_namespace", PLUGIN_NAMESPACE), ("plugin_version", PLUGIN_VERSION),
                                  ("aot", AOT))]
    return OpSchema(
        op_type, DOMAIN, 1, doc=doc,
        inputs=[OpSchema.FormalParameter(n, t, d) for n, t, d in inputs],
        outputs=[OpSchema.FormalParameter(n, t, d) for n, t, d in outputs],
        type_constraints=[(n, list(ts), d) for n, ts, d in type_constraints],
        attributes=attrs,
    )


def register_once(op_schema: onnx.defs.OpSchema) -> None:
    if not onnx.defs.has(op_schema.name, op_schema.domain):
        onnx.defs.register_schema(op_schema)
