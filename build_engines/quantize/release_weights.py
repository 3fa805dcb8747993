"""The released checkpoint's fp8/fp4 weights as engine initializers, stored as released and dequantized in the graph.

Why a graph rewrite: the step modules (and so the exporter) need plain float weights, and the exporter renames and
transposes them (`x @ W.t()` becomes a MatMul with an initializer `t_3` = W^T; every MoE's experts are one
concatenated matrix). So the fp32 graph is exported first, each weight initializer is identified by value (the
exact fp32 bits the loader dequantizes each stored tensor to: W, W^T, or a concatenation of pieces W_e^T along
either axis), and replaced by the stored bytes plus standard ONNX ops that rebuild exactly those bits:

* fp8 e4m3 block-scaled weight (`<name>.weight` + ue8m0 `<name>.scale`, blocks b0 x b1): a FLOAT8E4M3FN initializer
  holding the release's bytes in the release's [out, in] layout, a UINT8 initializer holding the release's e8m0 scale
  bytes, and `DequantizeLinear(axis=1, block_size=b1)` (opset 21 blocked quantization) whose scale is the e8m0 bytes
  decoded through a 256-entry power-of-two table (`Gather`) and repeated over the b0 rows of each block. onnxruntime
  1.32 runs blocked fp8 DequantizeLinear on CPU; its DequantizeLinear with a FLOAT8E8M0 scale has no CPU kernel, hence
  the table (exact: every entry is a power of two).
* packed fp4 e2m1 expert weight (int8 [out, in/2], two codes per byte, low nibble first, ue8m0 scale per 32 along
  in): a UINT8 initializer holding the release's bytes, decoded by `Gather` from a [256, 2] table of the two e2m1
  values of each byte, then one scale per block applied by reshape + broadcast `Mul` (the arithmetic of a blocked
  DequantizeLinear). onnxruntime 1.32 has no CPU kernel for FLOAT4E2M1 (DequantizeLinear-23 or Cast; measured), so
  this is the equivalent; the bytes are the ones a FLOAT4E2M1 [out, in] tensor would hold.

The product of an e4m3 or e2m1 value and a power of two is exact in fp32, so the rebuilt weights equal the fp32 detour's
weights bit for bit and the graph computes the same logits. What stays float: the release's bf16/f32 tensors (embedding,
head, norms, gates, mHC, compressor, indexer weights_proj), as the fp32 export writes them.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ced.model.quant_formats import E2M1_VALUES

BLOCKED_DQ_OPSET = 21  # first opset whose DequantizeLinear takes block_size
# How a runtime should open these graphs on onnxruntime: fold the dequantization chains into constants at load.
# Why: onnxruntime keeps DequantizeLinear out of constant folding (for its QDQ fusions, none of which applies here), so
# by default every step dequantizes every fp8 weight and MatMul takes the rebuilt W^T through a fused Transpose
# (FusedMatMul, transB), whose rounding differs from the fp32 graph's MatMul by ~1e-6. Folded, the graph runs the fp32
# graph's kernels on the same weight bits: bit-identical outputs at fp32 speed. The file still stores fp8/fp4 bytes.
SESSION_CONFIG = {"session.disable_quant_qdq": "1"}
FP4_BLOCK = 32  # ue8m0 scale per 32 values along `in` (release format)
E8M0_TABLE = "release.e8m0_table"
FP4_TABLE = "release.fp4_pair_table"


class ReleaseWeightError(ValueError):
    """The stored weights and the exported graph do not fit together; the message names the tensors."""


@dataclass(frozen=True)
class StoredWeight:
    """One quantized tensor of the checkpoint: its stored bytes and what the loader dequantizes it to."""

    name: str
    kind: str  # "fp8" | "fp4"
    data: torch.Tensor  # float8_e4m3fn [out, in] or int8 [out, in/2]
    scale: torch.Tensor  # float8_e8m0fnu
    values: np.ndarray  # float32 [out, in]: the loader's dequantized weight (what the fp32 export holds)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def block(self) -> tuple[int, int]:
        """(rows, cols) of one scale block, from the shapes (the release's 32x32 or V4's 128x128 for fp8)."""
        out, inn = self.shape
        rows, cols = self.scale.shape
        if self.kind == "fp4":
            if rows != out or inn % cols or inn // cols != FP4_BLOCK:
                raise ReleaseWeightError(f"{self.name}: fp4 scale {tuple(self.scale.shape)} is not one per "
                                         f"{FP4_BLOCK} along in for {self.shape}")
            return 1, FP4_BLOCK
        b0, b1 = _block_extent(out, rows), _block_extent(inn, cols)
        return b0, b1


def _block_extent(n: int, blocks: int) -> int:
    """The block extent that maps n values onto `blocks` scales: a power of two (32 or 128 in the releases)."""
    b = 1 << max(0, math.ceil(math.log2(n / blocks)))
    if math.ceil(n / b) != blocks:
        raise ReleaseWeightError(f"cannot find a power-of-two block mapping {n} values to {blocks} scales")
    return b


@dataclass
class Piece:
    """One stored tensor inside one graph initializer: the initializer (or its slice) is
    Transpose(Reshape(W, shape), perm)."""

    weight: StoredWeight
    shape: tuple[int, ...]
    perm: tuple[int, ...]


@dataclass
class Match:
    initializer: str
    axis: int  # concatenation axis of the pieces (a single piece uses 0)
    pieces: list[Piece] = field(default_factory=list)


def stored_weights(raw: dict[str, torch.Tensor], dequantized: dict[str, torch.Tensor]) -> dict[str, StoredWeight]:
    """The checkpoint's fp8 and packed-fp4 tensors (by parameter name) with their scales and dequantized values."""
    out = {}
    for name, tensor in raw.items():
        if tensor.dtype == torch.float8_e4m3fn:
            kind = "fp8"
        elif tensor.dtype in (torch.int8, torch.uint8):
            kind = "fp4"
        else:
            continue
        if name not in dequantized:  # an optional extra the loader skips (Engram, DSpark)
            continue
        scale = raw[name[: -len(".weight")] + ".scale"]
        if bool(scale.view(torch.uint8).eq(255).any()):
            raise ReleaseWeightError(f"{name}: its e8m0 scale holds the NaN code 0xFF")
        out[name] = StoredWeight(name, kind, tensor, scale, dequantized[name].float().numpy())
    return out


Index = dict[tuple[int, str], StoredWeight]


def _key(array: np.ndarray) -> tuple[int, str]:
    a = np.ascontiguousarray(array, dtype=np.float32)
    return a.size, hashlib.sha256(a.tobytes()).hexdigest()


def _find(array: np.ndarray, index: Index) -> Piece | None:
    """The stored weight W with array == Transpose(Reshape(W, shape), perm) for some axis order, if any. Covers the
    plain weight, W^T (`x @ W.t()` folded by the exporter) and grouped forms such as wo_a's
    W.view(G, r, -1).transpose(1, 2) when the exporter folds them."""
    for perm in itertools.permutations(range(array.ndim)):
        unpermuted = np.ascontiguousarray(array.transpose(np.argsort(perm)))
        hit = index.get(_key(unpermuted))
        if hit is not None:
            return Piece(hit, tuple(unpermuted.shape), tuple(perm))
    return None


def match_initializers(model: onnx.ModelProto, weights: dict[str, StoredWeight]) -> list[Match]:
    """Every float initializer that is a stored weight in some axis order, or a concatenation of such pieces along
    one axis (every MoE's experts). Raises when two stored weights hold identical values (ambiguous)."""
    index: Index = {}
    for w in weights.values():
        key = _key(w.values)
        if key in index:
            raise ReleaseWeightError(f"{w.name} and {index[key].name} hold identical values; cannot tell them apart")
        index[key] = w
    sizes = {w.values.size for w in weights.values()}
    extents = sorted({d for w in weights.values() for d in w.shape})
    matches: list[Match] = []
    for init in model.graph.initializer:
        if init.data_type != TensorProto.FLOAT or len(init.dims) < 2:
            continue
        array = numpy_helper.to_array(init)
        whole = _find(array, index) if array.size in sizes else None
        if whole is not None:
            matches.append(Match(init.name, 0, [whole]))
            continue
        for axis, size in ((a, s) for a in range(array.ndim) for s in extents):
            n = array.shape[axis]
            if size >= n or n % size or array.size // n * size not in sizes:
                continue
            pieces = [_find(chunk, index) for chunk in np.split(array, n // size, axis=axis)]
            if all(p is not None for p in pieces):
                matches.append(Match(init.name, axis, pieces))  # type: ignore[arg-type]
                break
    return matches


def _tables() -> list[TensorProto]:
    """The two decode tables: 2^(e - 127) for each e8m0 byte (255 = NaN, refused on input), and the pair of e2m1
    values each packed fp4 byte holds (low nibble first)."""
    e8m0 = np.append(np.ldexp(np.ones(255, np.float32), (np.arange(255) - 127).astype(np.int32)), np.float32(np.nan))
    values = E2M1_VALUES.numpy()
    pairs = np.stack([values[np.arange(256) & 0x0F], values[np.arange(256) >> 4]], axis=-1).astype(np.float32)
    return [numpy_helper.from_array(e8m0, E8M0_TABLE), numpy_helper.from_array(pairs, FP4_TABLE)]


class _Emitter:
    """Writes the initializers and nodes that rebuild one stored weight (each stored tensor is written once)."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.plain: dict[str, str] = {}
        self.built: dict[tuple[str, tuple[int, ...], tuple[int, ...]], str] = {}

    def _node(self, op: str, inputs: list[str], output: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=f"{output}.node", **attrs))
        return output

    def _const(self, name: str, values: list[int]) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    def _raw(self, name: str, data_type: int, tensor: torch.Tensor) -> str:
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        self.initializers.append(helper.make_tensor(name, data_type, list(tensor.shape), vals=raw, raw=True))
        return name

    def _scales(self, w: StoredWeight, prefix: str) -> str:
        codes = self._raw(f"{prefix}.scale_e8m0", TensorProto.UINT8, w.scale.view(torch.uint8))
        index = self._node("Cast", [codes], f"{prefix}.scale_index", to=TensorProto.INT32)
        return self._node("Gather", [E8M0_TABLE, index], f"{prefix}.scale")

    def weight(self, piece: Piece) -> str:
        """The name of a float tensor equal to Transpose(Reshape(W, piece.shape), piece.perm), bit for bit."""
        w = piece.weight
        key = (w.name, piece.shape, piece.perm)
        if key in self.built:
            return self.built[key]
        if w.name not in self.plain:
            self.plain[w.name] = self._fp8(w) if w.kind == "fp8" else self._fp4(w)
        name = self.plain[w.name]
        tag = f"{w.name}.{'x'.join(map(str, piece.shape))}.{''.join(map(str, piece.perm))}"
        if piece.shape != w.shape:
            name = self._node("Reshape", [name, self._const(f"{tag}.shape", list(piece.shape))], f"{tag}.reshaped")
        if piece.perm != tuple(range(len(piece.perm))):
            name = self._node("Transpose", [name], f"{tag}.permuted", perm=list(piece.perm))
        self.built[key] = name
        return name

    def _fp8(self, w: StoredWeight) -> str:
        out, inn = w.shape
        b0, b1 = w.block()
        rows, cols = w.scale.shape
        data = self._raw(f"{w.name}.fp8", TensorProto.FLOAT8E4M3FN, w.data)
        scale = self._scales(w, w.name)
        if b0 > 1:  # one scale row per block of b0 weight rows: repeat each row b0 times, cut a partial last block
            scale = self._node("Unsqueeze", [scale, self._const(f"{w.name}.axis1", [1])], f"{w.name}.scale_3d")
            scale = self._node("Expand", [scale, self._const(f"{w.name}.expand", [rows, b0, cols])],
                               f"{w.name}.scale_rep")
            scale = self._node("Reshape", [scale, self._const(f"{w.name}.rows", [rows * b0, cols])],
                               f"{w.name}.scale_rows")
            if rows * b0 != out:
                scale = self._node("Slice", [scale, self._const(f"{w.name}.lo", [0]),
                                             self._const(f"{w.name}.hi", [out]),
                                             self._const(f"{w.name}.axis0", [0])], f"{w.name}.scale_cut")
        return self._node("DequantizeLinear", [data, scale], f"{w.name}.dq", axis=1, block_size=b1)

    def _fp4(self, w: StoredWeight) -> str:
        out, inn = w.shape
        _, block = w.block()
        data = self._raw(f"{w.name}.fp4_packed", TensorProto.UINT8, w.data.view(torch.uint8))
        index = self._node("Cast", [data], f"{w.name}.codes", to=TensorProto.INT32)
        values = self._node("Gather", [FP4_TABLE, index], f"{w.name}.pairs")  # [out, in/2, 2]
        values = self._node("Reshape", [values, self._const(f"{w.name}.blocks", [out, inn // block, block])],
                            f"{w.name}.e2m1")
        scale = self._node("Unsqueeze", [self._scales(w, w.name), self._const(f"{w.name}.axis2", [2])],
                           f"{w.name}.scale_3d")
        scaled = self._node("Mul", [values, scale], f"{w.name}.scaled")
        return self._node("Reshape", [scaled, self._const(f"{w.name}.shape", [out, inn])], f"{w.name}.dq")


@dataclass
class RewriteReport:
    initializers_replaced: int
    stored: dict[str, dict[str, object]]  # parameter name -> kind, shape, block, stored bytes
    fp32_initializer_bytes: int  # what is still float in the graph (bf16/f32 tensors of the release, constants)

    def as_dict(self) -> dict[str, object]:
        return {"initializers_replaced": self.initializers_replaced, "stored_weights": len(self.stored),
                "stored_bytes": sum(int(s["bytes"]) for s in self.stored.values()),  # type: ignore[call-overload]
                "float_initializer_bytes": self.fp32_initializer_bytes,
                "by_kind": {k: sum(1 for s in self.stored.values() if s["kind"] == k) for k in ("fp8", "fp4")},
                "weights": self.stored}


def rewrite_graph(model: onnx.ModelProto,
                  weights: dict[str, StoredWeight]) -> tuple[onnx.ModelProto, list[str], RewriteReport]:
    """Replace (in place) every initializer that holds stored weights by their stored bytes and the nodes that
    dequantize them; returns the model, the names of the stored weights it uses, and a report."""
    matches = match_initializers(model, weights)
    emitter = _Emitter()
    used: set[str] = set()
    for m in matches:
        parts = [emitter.weight(p) for p in m.pieces]
        used.update(p.weight.name for p in m.pieces)
        if len(parts) == 1:
            emitter.nodes.append(helper.make_node("Identity", parts, [m.initializer], name=f"{m.initializer}.rebuilt"))
        else:
            emitter.nodes.append(helper.make_node("Concat", parts, [m.initializer], name=f"{m.initializer}.rebuilt",
                                                  axis=m.axis))
    replaced = {m.initializer for m in matches}
    kept = [t for t in model.graph.initializer if t.name not in replaced]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + _tables() + emitter.initializers)
    # the rebuilt weights come first: the graph stays topologically sorted
    nodes = emitter.nodes + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    for opset in list(model.opset_import) + [o for f in model.functions for o in f.opset_import]:
        if opset.domain in ("", "ai.onnx") and opset.version < BLOCKED_DQ_OPSET:
            opset.version = BLOCKED_DQ_OPSET  # the local functions' standard ops mean the same at 21 (types only widen)
    model.ir_version = max(model.ir_version, 10)
    stored = {}
    for name in sorted(used):
        w = weights[name]
        stored[name] = {"kind": w.kind, "shape": list(w.shape), "block": list(w.block()),
                        "bytes": int(w.data.numel() * w.data.element_size() + w.scale.numel())}
    float_bytes = sum(int(np.prod(t.dims)) * 4 for t in kept if t.data_type == TensorProto.FLOAT)
    return model, sorted(used), RewriteReport(len(replaced), stored, float_bytes)
