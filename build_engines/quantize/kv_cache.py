"""fp8 KV state (`--kv-quant fp8`): the window rings and global-KV stores cross the graph boundary as fp8 e4m3.

What changes in a graph (an ONNX rewrite of the PTQ'd encoder/decoder, no re-export):
- every state *input* (`rings`, `kv_<s>` / the decoder's `kv` mirror) becomes FLOAT8E4M3FN and is read through one
  `DequantizeLinear` (the rings per layer: `axis=1`, one scale per ring layer);
- every value that *becomes* state is rounded where it is produced: each ring layer's latent, each source's new
  entries, go through `QuantizeLinear` -> `DequantizeLinear` (scalar scale) before any node reads them, so the step
  itself attends to exactly what later steps will read back. That keeps the fp32 engines' invariances: prefill
  chunking changes no bit, and a bounded replay's rings equal the rings decode steps would have written;
- the state *outputs* (`ring_rows`, `new_kv_<s>` of ratio-2 sources) are FLOAT8E4M3FN (`QuantizeLinear` of the
  already-rounded values: the same codes); the hand-over's `global_kv` stays fp32 (the serving contract carries it
  as FP32 between the encoder and decoder models) holding the rounded values, and the rows keep its codes
  (`export/rows.fp8_encode`, exact on those values).
Index keys, the ratio-2 compressor's pending pair and the hand-over rows stay fp32 (the index keys decide top-k
selection; the article's fp4 indexer keys are a different scheme, not attempted here).

Scales: per tensor (per ring layer, per global-KV source), max |x| over the calibration run's state values divided
by 448 (the largest e4m3fn value); values beyond it saturate. Recorded in the manifest (`quant.kv_cache`).

Why dequantize whole stores at the input and not after the gather: ONNX (opset 19) Gather/GatherND/Concat do not take
float8 tensors (onnxruntime rejects the graph), so the stored rows are dequantized before the attention gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ced.steps.kv_state import KVScales
from ced.steps.layout import StepLayout
from ced.steps.rows import FP8_MAX

KV_QUANT_MODES = ("none", "fp8")
Arrays = dict[str, np.ndarray]


@dataclass
class StateAmax:
    """Running max |x| of each state tensor over the calibration run (per ring layer, per source)."""

    encoder_rings: np.ndarray
    decoder_rings: np.ndarray
    stores: dict[int, float] = field(default_factory=dict)

    @classmethod
    def empty(cls, layout: StepLayout) -> "StateAmax":
        return cls(np.zeros(len(layout.encoder_ring_layers)), np.zeros(len(layout.decoder_ring_layers)),
                   {s: 0.0 for s in layout.sources})

    def encoder(self, layout: StepLayout, out: Arrays, starts: list[int], steps: int) -> None:
        """One encoder step's outputs: ring latents, layer E's new entries, the valid new entries of ratio-2 sources."""
        self.encoder_rings = np.maximum(self.encoder_rings, np.abs(out["ring_rows"]).max(axis=(0, 2, 3)))
        for s in layout.sources:
            if layout.ratio[s] == 1:
                values = out["global_kv"]
            else:
                counts = [(p % 2 + steps) // 2 for p in starts]
                values = np.concatenate([out[f"new_kv_{s}"][b, :n] for b, n in enumerate(counts)]
                                        + [np.zeros((0, layout.cfg.head_dim))])
            if values.size:
                self.stores[s] = max(self.stores[s], float(np.abs(values).max()))

    def decoder(self, out: Arrays, real: list[int]) -> None:
        """One decoder step's ring latents; `real` = each row's real (not front-padding) rows, counted from the end."""
        for b, n in enumerate(real):
            self.decoder_rings = np.maximum(self.decoder_rings, np.abs(out["ring_rows"][b][:, -n:]).max(axis=(1, 2)))


def scales_from_amax(layout: StepLayout, amax: StateAmax) -> KVScales:
    """Per-tensor scales from the calibration run's running max |x| (amax / 448)."""

    def scale(a: float) -> float:
        if not np.isfinite(a) or a <= 0:
            raise ValueError(f"state amax {a} from calibration: no scale can be derived")
        return float(np.float32(a / FP8_MAX))

    return KVScales(tuple(scale(a) for a in amax.encoder_rings), tuple(scale(a) for a in amax.decoder_rings),
                    {s: scale(a) for s, a in amax.stores.items()}, layout.cfg.first_decoder_layer)


# ---------------------------------------------------------------------------------------------------------- rewrite
class _Rewriter:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model, self.graph = model, model.graph
        self.added = {"QuantizeLinear": 0, "DequantizeLinear": 0}

    def producer(self, name: str) -> onnx.NodeProto:
        for node in self.graph.node:
            if name in node.output:
                return node
        raise ValueError(f"no node produces {name!r}")

    def consumers(self, name: str) -> list[onnx.NodeProto]:
        return [n for n in self.graph.node if name in n.input]

    def const(self, name: str, values: list[float], dtype: int = TensorProto.FLOAT, scalar: bool = True) -> str:
        dims = [] if scalar else [len(values)]
        self.graph.initializer.append(helper.make_tensor(name, dtype, dims, values))
        return name

    def scale_zero(self, tag: str, scales: list[float]) -> tuple[str, str]:
        scalar = len(scales) == 1
        return (self.const(f"{tag}.kv_scale", scales, scalar=scalar),
                self.const(f"{tag}.kv_zero", [0.0] * len(scales), TensorProto.FLOAT8E4M3FN, scalar=scalar))

    def node(self, op: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.added[op] += 1
        self.graph.node.append(helper.make_node(op, inputs, [output], name=f"kv_state_{op}_{self.added[op]}", **attrs))
        return output

    def rename_output(self, name: str, new: str) -> None:
        node = self.producer(name)
        node.output[list(node.output).index(name)] = new

    def redirect(self, name: str, new: str) -> None:
        for node in self.consumers(name):
            for i, x in enumerate(node.input):
                if x == name:
                    node.input[i] = new

    def round_in_place(self, name: str, scale: float, tag: str) -> None:
        """Every reader of `name` sees DequantizeLinear(QuantizeLinear(name)) (same name, rounded values)."""
        s, z = self.scale_zero(tag, [scale])
        self.rename_output(name, f"{name}.f32")
        q = self.node("QuantizeLinear", [f"{name}.f32", s, z], f"{name}.fp8")
        self.node("DequantizeLinear", [q, s, z], name)

    def fp8_input(self, name: str, scales: list[float], axis: int | None) -> None:
        """Graph input `name` becomes FLOAT8E4M3FN; its readers get the DequantizeLinear of it."""
        s, z = self.scale_zero(name, scales)
        attrs = {} if axis is None else {"axis": axis}
        dq = f"{name}.dq"
        self.redirect(name, dq)
        self.node("DequantizeLinear", [name, s, z], dq, **attrs)
        self._retype(self.graph.input, name)

    def fp8_output(self, name: str, scales: list[float], axis: int | None) -> None:
        """Graph output `name` becomes the FLOAT8E4M3FN codes of what was computed (already rounded upstream)."""
        s, z = self.scale_zero(f"{name}.out", scales)
        attrs = {} if axis is None else {"axis": axis}
        rounded = f"{name}.rounded"
        self.rename_output(name, rounded)
        self.redirect(name, rounded)  # in-graph readers keep the fp32 (rounded) values
        self.node("QuantizeLinear", [rounded, s, z], name, **attrs)
        self._retype(self.graph.output, name)

    @staticmethod
    def _retype(values: Any, name: str) -> None:
        for v in values:
            if v.name == name:
                v.type.tensor_type.elem_type = TensorProto.FLOAT8E4M3FN
                return
        raise ValueError(f"no graph input/output {name!r}")

    def ring_latents(self, output: str) -> list[str]:
        """The per-layer latents stacked into `ring_rows` (Concat of Unsqueeze(latent)), in layer order."""
        stack = self.producer(output)
        if stack.op_type != "Concat":
            raise ValueError(f"{output} is made by {stack.op_type}, expected the Concat of torch.stack")
        latents = []
        for name in stack.input:
            unsqueeze = self.producer(name)
            if unsqueeze.op_type != "Unsqueeze":
                raise ValueError(f"{output}: input {name} is made by {unsqueeze.op_type}, expected Unsqueeze")
            latents.append(unsqueeze.input[0])
        return latents

    def finish(self) -> None:
        """Nodes in topological order again (the new ones were appended), opset >= 19 (float8 Q/DQ)."""
        nodes = list(self.graph.node)
        available = {i.name for i in self.graph.input} | {t.name for t in self.graph.initializer} | {""}
        missing = [sum(i not in available for i in set(n.input)) for n in nodes]
        waiting: dict[str, list[int]] = {}
        for k, n in enumerate(nodes):
            for i in set(n.input):
                if i not in available:
                    waiting.setdefault(i, []).append(k)
        ready = [k for k, m in enumerate(missing) if m == 0]
        ordered = []
        while ready:
            k = ready.pop(0)
            ordered.append(nodes[k])
            for out in nodes[k].output:
                for j in waiting.pop(out, []):
                    missing[j] -= 1
                    if missing[j] == 0:
                        ready.append(j)
        if len(ordered) != len(nodes):
            raise ValueError("the rewritten graph has a cycle or an unproduced input")
        del self.graph.node[:]
        self.graph.node.extend(ordered)
        for opset in self.model.opset_import:
            if opset.domain in ("", "ai.onnx") and opset.version < 19:
                opset.version = 19


def quantize_encoder_state(model: onnx.ModelProto, layout: StepLayout, scales: KVScales) -> dict[str, int]:
    """Rewrite an encoder graph (in place) for fp8 rings and global-KV stores; returns the Q/DQ nodes added."""
    r = _Rewriter(model)
    rings = list(scales.encoder_rings)
    for latent, scale in zip(r.ring_latents("ring_rows"), rings, strict=True):
        r.round_in_place(latent, scale, latent)
    for s in layout.sources:
        new = "global_kv" if layout.ratio[s] == 1 else f"new_kv_{s}"
        r.round_in_place(new, scales.stores[s], new)
        if layout.ratio[s] == 2:
            r.fp8_output(new, [scales.stores[s]], None)
        r.fp8_input(f"kv_{s}", [scales.stores[s]], None)
    r.fp8_output("ring_rows", rings, 1)
    r.fp8_input("rings", rings, 1)
    r.finish()
    return r.added


def quantize_decoder_state(model: onnx.ModelProto, layout: StepLayout, scales: KVScales) -> dict[str, int]:
    """Rewrite a decoder graph (in place) for fp8 rings and the fp8 mirror of layer E's store."""
    r = _Rewriter(model)
    rings = list(scales.decoder_rings)
    for latent, scale in zip(r.ring_latents("ring_rows"), rings, strict=True):
        r.round_in_place(latent, scale, latent)
    r.fp8_output("ring_rows", rings, 1)
    r.fp8_input("rings", rings, 1)
    r.fp8_input("kv", [scales.stores[scales.handover_source]], None)
    r.finish()
    return r.added


def quantize_state(path: Path, kind: str, layout: StepLayout, scales: KVScales) -> dict[str, int]:
    """Rewrite the graph file at `path` (`kind` encoder | decoder) in place."""
    model = onnx.load(str(path))
    added = (quantize_encoder_state if kind == "encoder" else quantize_decoder_state)(model, layout, scales)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return added


# ---------------------------------------------------------------------------------------------------------- running
