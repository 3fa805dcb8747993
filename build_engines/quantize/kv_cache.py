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
from typing import Any, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from build_engines.export.layout import StepLayout
from build_engines.export.rows import FP8_MAX, KVFormat, KVStateLayout
from build_engines.model.dspark_spec import DSparkSpec

KV_QUANT_MODES = ("none", "fp8")
FP8_TYPE = "tensor(float8e4m3fn)"
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
                values = np.concatenate([out[f"new_kv_{s}"][b, :n] for b, n in enumerate(counts)] + [np.zeros((0, layout.cfg.head_dim))])
            if values.size:
                self.stores[s] = max(self.stores[s], float(np.abs(values).max()))

    def decoder(self, out: Arrays, real: list[int]) -> None:
        """One decoder step's ring latents; `real` = each row's real (not front-padding) rows, counted from the end."""
        for b, n in enumerate(real):
            self.decoder_rings = np.maximum(self.decoder_rings, np.abs(out["ring_rows"][b][:, -n:]).max(axis=(1, 2)))


@dataclass(frozen=True)
class KVScales:
    """Per-tensor fp8 scales of the state (amax / 448)."""

    encoder_rings: tuple[float, ...]
    decoder_rings: tuple[float, ...]
    stores: dict[int, float]
    handover_source: int  # layer E: the store the hand-over's global_kv feeds (and the decoder's mirror)

    @classmethod
    def from_amax(cls, layout: StepLayout, amax: StateAmax) -> "KVScales":
        def scale(a: float) -> float:
            if not np.isfinite(a) or a <= 0:
                raise ValueError(f"state amax {a} from calibration: no scale can be derived")
            return float(np.float32(a / FP8_MAX))

        return cls(tuple(scale(a) for a in amax.encoder_rings), tuple(scale(a) for a in amax.decoder_rings),
                   {s: scale(a) for s, a in amax.stores.items()}, layout.cfg.first_decoder_layer)

    def describe(self) -> dict[str, Any]:
        return {"encoder_rings": list(self.encoder_rings), "decoder_rings": list(self.decoder_rings),
                "stores": {str(s): v for s, v in self.stores.items()}, "handover_source": self.handover_source}

    @classmethod
    def from_manifest(cls, kv: dict[str, Any]) -> "KVScales":
        scales = kv["scales"]
        return cls(tuple(scales["encoder_rings"]), tuple(scales["decoder_rings"]), {int(s): v for s, v in scales["stores"].items()},
                   int(scales["handover_source"]))

    def format(self) -> KVFormat:
        return KVFormat(self.stores[self.handover_source])


def kv_layout(cfg, manifest: dict[str, Any] | None) -> StepLayout:  # type: ignore[no-untyped-def]
    """The rows' layout for an engine directory: fp8 state when its manifest says `quant.kv_cache`, else fp32."""
    kv = (manifest or {}).get("quant", {}).get("kv_cache")
    layout = KVStateLayout(cfg, KVScales.from_manifest(kv).format()) if kv else StepLayout(cfg)
    drafter = (manifest or {}).get("drafter")  # the build's DSpark drafter (graph `drafter`, decoder output `draft_main`)
    layout.drafter = DSparkSpec.from_release(cfg, drafter) if drafter else None
    return layout


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
def fp8_inputs(session: Any) -> set[str]:
    """Names of a session's FLOAT8E4M3FN inputs (fed as uint8 codes)."""
    return {i.name for i in session.get_inputs() if i.type == FP8_TYPE}


def as_fp8(ort: Any, name: str, array: np.ndarray) -> Any:
    """uint8 codes -> a FLOAT8E4M3FN OrtValue over the same memory (no copy)."""
    if array.dtype != np.uint8:
        raise TypeError(f"{name}: an fp8-state engine takes uint8 fp8 codes, got {array.dtype} (rows made with a fp32 layout? "
                        f"open the engine's layout with kv_layout)")
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(array), TensorProto.FLOAT8E4M3FN)


def session_runner(session: Any) -> Callable[[Arrays], Arrays]:
    """feed -> outputs for any session: fp8 inputs wrapped as OrtValues, fp8 outputs come back as uint8 arrays."""
    import onnxruntime as ort

    names = [o.name for o in session.get_outputs()]
    inputs = [i.name for i in session.get_inputs()]
    fp8 = fp8_inputs(session)

    def run(feed: Arrays) -> Arrays:
        values = {n: as_fp8(ort, n, feed[n]) if n in fp8 else feed[n] for n in inputs}
        return dict(zip(names, session.run(None, values)))

    return run


def kv_runner(path: Path, config: dict[str, str] | None = None) -> Callable[[Arrays], Arrays]:
    """`onnx_build.ort_runner` for any engine graph (fp8 state or not), with optional session config entries."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    return session_runner(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))
