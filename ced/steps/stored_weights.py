"""Step-module weights kept as the checkpoint stores them and dequantized inside the step (exportable ops).

Why: the released DeepSeek-V4.1 stores its projections in fp8 e4m3 (32x32 ue8m0 blocks) and its routed experts in
packed fp4 e2m1 (a ue8m0 scale per 32 along K). Dequantized to fp32 before export, a role grows 4x (fp8) to 8x (fp4):
about 1.1 TB per role at full size, where the stored role is ~149 GB. A `StoredMatrix` holds the stored bytes
(fp8 codes and e8m0 scales as uint8, packed fp4 pairs as uint8, bf16/f32 tensors as they are) and rebuilds the float
weight where the step reads it, with three exact table lookups and a multiply:

* fp8: `E4M3[codes] * E8M0[scale]` with the scale repeated over its block;
* packed fp4: `FP4_PAIRS[codes]` (the two e2m1 values of each byte, low nibble first) times the per-32 scale;
* an e4m3 or e2m1 value times a power of two is exact in fp32, so the weight equals the loader's dequantization
  (`quant_formats.dequantize_fp8_blocks` / `dequantize_fp4_packed`) bit for bit, and so does the graph's.

The graph then holds the stored bytes as initializers (uint8 / bf16), the engine file is the role's stored size,
and a step dequantizes one weight (one expert chunk for the MoE, `StoredExperts`) at a time, so running the module
or the graph costs the stored bytes plus one dequantized weight.
"""

from __future__ import annotations

import ctypes
import math
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.scan import scan

from ced.model.moe import MoE
from ced.model.primitives import ACT_QUANT_BLOCK
from ced.model.quant_formats import E2M1_VALUES, QuantFormatError, infer_block_dim
from ced.steps.graph_ops import DenseExperts, fp8_qdq

FP4_BLOCK = 32  # ue8m0 scale per 32 values along K (release format)
EXPERT_CHUNK_BYTES = 16 << 20  # fp32 weights one MoE chunk dequantizes at once (at least one expert): see StoredExperts
EXPERT_CHUNK_ENV = "MOL2_EXPERT_CHUNK_BYTES"  # overrides it (`python -m build_engines build --expert-chunk-bytes N`)

_CODES = torch.arange(256, dtype=torch.uint8)
E4M3_TABLE = _CODES.view(torch.float8_e4m3fn).float()  # code -> value (0x7F / 0xFF: NaN, as the cast)
E8M0_TABLE = _CODES.view(torch.float8_e8m0fnu).float()  # code -> 2^(code - 127) (0xFF: NaN)
FP4_PAIR_TABLE = torch.stack(
    (E2M1_VALUES.float()[(_CODES & 0x0F).long()], E2M1_VALUES.float()[(_CODES >> 4).long()]), -1)

KINDS = ("fp8", "fp4", "float")


class StoredWeightError(ValueError):
    """A stored tensor does not fit the weight it stands for; the message names it."""


def dequantize(kind: str, block: tuple[int, int], shape: tuple[int, int], codes: torch.Tensor, scale: torch.Tensor,
               tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The fp32 [out, in] weight of stored `codes` and `scale` (uint8; see `StoredMatrix`), in exportable ops.
    `tables`: (e8m0 values, code values) as `lookup_tables` gives them, where the caller holds them (a Scan body
    must read them from its own inputs)."""
    out, inn = shape
    if kind == "float":
        return codes.float()
    e8m0, table = tables if tables is not None else lookup_tables(kind, codes.device)
    scale_values = e8m0[scale.long()]
    if kind == "fp4":
        values = table[codes.long()].reshape(out, -1, FP4_BLOCK)
        return (values * scale_values.unsqueeze(-1)).reshape(out, -1)[:, :inn]
    b0, b1 = block
    full = scale_values.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inn]
    return table[codes.long()] * full


def lookup_tables(kind: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(code -> e8m0 scale value, code -> weight value) of a storage kind: e4m3 values, or e2m1 pairs for packed fp4."""
    return E8M0_TABLE.to(device), (FP4_PAIR_TABLE if kind == "fp4" else E4M3_TABLE).to(device)


class StoredMatrix(nn.Module):
    """One [out, in] weight as stored: `codes` (uint8 fp8 codes, uint8 packed fp4 pairs, or the float tensor itself)
    and `scale` (uint8 e8m0 codes; empty for floats). `value()` is the fp32 weight, in exportable ops."""

    def __init__(self, name: str, kind: str, codes: torch.Tensor, scale: torch.Tensor | None,
                 shape: tuple[int, int]) -> None:
        super().__init__()
        if kind not in KINDS:
            raise StoredWeightError(f"{name}: unknown storage kind {kind!r}")
        self.name, self.kind, self.shape = name, kind, shape
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale if scale is not None else torch.zeros(0, dtype=torch.uint8))
        out, inn = shape
        if kind == "fp8":
            if tuple(codes.shape) != shape or scale is None or scale.ndim != 2:
                raise StoredWeightError(f"{name}: fp8 codes {tuple(codes.shape)} / scale do not fit {shape}")
            try:
                self.block = (infer_block_dim(out, scale.shape[0], "row"), infer_block_dim(inn, scale.shape[1], "col"))
            except QuantFormatError as exc:
                raise StoredWeightError(f"{name}: {exc}") from exc
        elif kind == "fp4":
            if (tuple(codes.shape) != (out, inn // 2) or scale is None
                    or tuple(scale.shape) != (out, math.ceil(inn / FP4_BLOCK))):
                raise StoredWeightError(f"{name}: packed fp4 codes {tuple(codes.shape)} / scale do not fit {shape} "
                                        f"(one e8m0 scale per {FP4_BLOCK} along in)")
            self.block = (1, FP4_BLOCK)
        else:
            if tuple(codes.shape) != shape:
                raise StoredWeightError(f"{name}: stored shape {tuple(codes.shape)} is not {shape}")
            self.block = (1, 1)

    @classmethod
    def from_stored(cls, name: str, stored: torch.Tensor, scale: torch.Tensor | None,
                    shape: tuple[int, int]) -> "StoredMatrix":
        """From the checkpoint's tensor (its own dtype) and its `.scale` tensor (or None)."""
        if stored.dtype == torch.float8_e4m3fn:
            kind = "fp8"
        elif stored.dtype in (torch.int8, torch.uint8):
            kind = "fp4"
        elif stored.dtype.is_floating_point:
            if scale is not None:
                raise StoredWeightError(f"{name} is {stored.dtype} but has a scale tensor")
            return cls(name, "float", stored, None, shape)
        else:
            raise StoredWeightError(f"{name}: unsupported stored dtype {stored.dtype}")
        if scale is None:
            raise StoredWeightError(f"{name} is {kind} but has no scale tensor")
        if scale.dtype != torch.float8_e8m0fnu:
            raise StoredWeightError(f"{name}: scale dtype {scale.dtype}, expected float8_e8m0fnu")
        return cls(name, kind, stored.view(torch.uint8), scale.view(torch.uint8), shape)

    @classmethod
    def concatenated(cls, name: str, parts: list["StoredMatrix"], dim: int) -> "StoredMatrix":
        """Several weights of one kind joined along out (dim 0) or in (dim 1), codes and scales alike; each part
        must end on a scale-block boundary along `dim` so the joined scales still address whole blocks."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.block for p in parts}) != 1:
            raise StoredWeightError(f"{name}: cannot join weights stored differently ({sorted(kinds)})")
        kind, block = kinds.pop(), parts[0].block
        if any(p.shape[dim] % block[dim] for p in parts[:-1]):
            raise StoredWeightError(f"{name}: a part does not end on a {block[dim]}-value scale block")
        other = {p.shape[1 - dim] for p in parts}
        if len(other) != 1:
            raise StoredWeightError(f"{name}: parts differ along the kept dimension ({sorted(other)})")
        shape = [0, 0]
        shape[dim], shape[1 - dim] = sum(p.shape[dim] for p in parts), other.pop()
        codes = torch.cat([p.codes for p in parts], dim)
        scale = torch.cat([p.scale for p in parts], dim) if kind != "float" else None
        return cls(name, kind, codes, scale, (shape[0], shape[1]))

    def value(self) -> torch.Tensor:
        """The fp32 [out, in] weight (exactly the loader's dequantization)."""
        return dequantize(self.kind, self.block, self.shape, self.codes, self.scale)

    def stored_bytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel()


class StoredLinear(nn.Module):
    """A bias-free Linear whose weight stays stored: `.weight` is the fp32 weight rebuilt where the step reads it.

    It keeps the replaced module's `quantize_input` (the release's fp8 activation rule, `quantizes_input`), so the
    steps' `FakeQuant.gemm_input` decides exactly as for the float module."""

    def __init__(self, stored: StoredMatrix, quantize_input: bool) -> None:
        super().__init__()
        self.stored, self.quantize_input = stored, quantize_input
        self.out_features, self.in_features = stored.shape

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.stored.value()

    def gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_qdq(x, ACT_QUANT_BLOCK) if self.quantize_input else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.gemm_input(x), self.weight)


class StoredStack(nn.Module):
    """C weights of one shape and storage kind as one stacked tensor (codes (C, ...), scale (C, ...)). The module walks
    them in a Python loop; the exported graph walks them with one ONNX Scan whose body dequantizes one weight per
    iteration (onnxruntime and TensorRT's ONNX parser, which maps Scan onto its loop layer, both run it).

    Why: as C separate weights each was its own graph nodes, initializers and exporter modules, about 1 MB of export
    and 0.3 MB of onnxruntime session per weight and layer at any width (measured along the expert axis, Dec 4). The
    release's 256 routed experts are one weight each at the default chunk budget: ~11,000 copies of that cost. Stacked,
    a layer's routed experts are one Scan, whatever their count, and still one weight dequantized at a time."""

    def __init__(self, name: str, groups: list[list[StoredMatrix]], dim: int) -> None:
        """Each group joined along `dim` (as `StoredMatrix.concatenated`) is one weight of the stack; the joined
        weights are written into the stack one at a time (one group's copy in flight, not the whole stack's)."""
        super().__init__()
        first = StoredMatrix.concatenated(name, groups[0], dim)
        self.name, self.kind, self.block, self.shape = name, first.kind, first.block, first.shape
        codes = first.codes.new_empty((len(groups), *first.codes.shape))
        scale = first.scale.new_empty((len(groups), *first.scale.shape))
        for i, group in enumerate(groups):
            joined = first if i == 0 else StoredMatrix.concatenated(name, group, dim)
            if (joined.kind, joined.block, joined.shape) != (self.kind, self.block, self.shape):
                raise StoredWeightError(f"{name}: weight {i} of the stack is stored as {joined.kind} {joined.shape}, "
                                        f"not {self.kind} {self.shape}")
            codes[i], scale[i] = joined.codes, joined.scale
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        # the Scan bodies read the lookup tables as the module's own buffers (a few KB): the module-level tables,
        # passed into a Scan from the full step, failed torch.export ("Cannot access data pointer" on the constant)
        e8m0, table = lookup_tables(self.kind, codes.device)
        self.register_buffer("e8m0_table", e8m0.clone())
        self.register_buffer("value_table", table.clone())

    def __len__(self) -> int:
        return self.codes.shape[0]

    def value(self, i: int) -> torch.Tensor:
        """Weight i in fp32 [out, in]."""
        return dequantize(self.kind, self.block, self.shape, self.codes[i], self.scale[i])

    def products(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (C, ..., out): x times each weight."""
        if len(self) == 1 or not torch.compiler.is_exporting():
            return torch.stack([x @ self.value(i).t() for i in range(len(self))])

        # x and the tables ride in the carry, unchanged (a body reads nothing but its own inputs)
        def body(carry: tuple[torch.Tensor, ...],
                 stored: tuple[torch.Tensor, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
            xs, e8m0, table = carry
            weight = dequantize(self.kind, self.block, self.shape, *stored, (e8m0, table))
            return (xs.clone(), e8m0.clone(), table.clone()), xs @ weight.t()

        return scan(body, (x, self.e8m0_table, self.value_table), (self.codes, self.scale))[1]

    def summed(self, parts: torch.Tensor) -> torch.Tensor:
        """parts (C, ..., in) -> (..., out): sum over i of parts[i] times weight i, added in order from a zero."""
        total = parts.new_zeros((*parts.shape[1:-1], self.shape[0]))
        if not torch.compiler.is_exporting():
            for i in range(len(self)):
                total = total + parts[i] @ self.value(i).t()
            return total

        def body(carry: tuple[torch.Tensor, ...],
                 item: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], tuple[()]]:
            running, e8m0, table = carry
            part, codes, scale = item
            weight = dequantize(self.kind, self.block, self.shape, codes, scale, (e8m0, table))
            return (running + part @ weight.t(), e8m0.clone(), table.clone()), ()

        return scan(body, (total, self.e8m0_table, self.value_table), (parts, self.codes, self.scale))[0][0]

    def stored_bytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel()


class StoredExperts(DenseExperts):
    """`DenseExperts` on stored weights: the same column layout ([expert g][w1 | w3][inter], shared expert last), the
    products taken over chunks of routed experts whose fp32 weights fit in `chunk_bytes` (at least one expert per
    chunk, as many in each chunk), each chunk dequantized only while it multiplies.

    Why chunks: one layer's routed experts dequantized at once would be ~8x their packed-fp4 bytes (at full size
    256 x 100 MB = 25.8 GB per layer); a chunk bounds that transient to a fixed size (a full-size expert alone is
    100 MB, so there a chunk is one expert), whatever the model's width or expert count. The routed chunks are one
    `StoredStack` (one Scan in the graph); the shared expert (the release stores it fp8, the routed experts fp4) is
    a weight of its own. The up-projection lays the chunks' columns side by side (the dense layout, so routing and
    LoRA are unchanged); the down-projection sums the chunks' partial products in chunk order from a zero, then adds
    the shared expert's (the graph and the module sum alike)."""

    def __init__(self, moe: MoE, chunk_bytes: int = EXPERT_CHUNK_BYTES) -> None:  # noqa: D107
        routed = list(moe.experts)
        experts = routed + [moe.shared_experts]
        if not routed:
            raise StoredWeightError("StoredExperts needs routed experts")
        if not all(isinstance(w, StoredLinear) for e in experts for w in (e.w1, e.w2, e.w3)):
            raise StoredWeightError("StoredExperts needs every expert projection stored (StoredLinear)")
        self.count, self.columns = len(experts), None  # every expert of the MoE (a parallel rank's are dequantized)
        self.inter = experts[0].w1.out_features
        if any(e.w1.out_features != self.inter for e in experts):
            raise StoredWeightError("dense experts need one intermediate width for routed and shared experts")
        self.limit = experts[0].limit
        quant = {w.quantize_input for e in experts for w in (e.w1, e.w2, e.w3)}
        if len(quant) != 1:
            raise StoredWeightError("dense experts need every expert projection quantized alike")
        self.quantize_input = quant.pop()
        self.per_chunk = experts_per_chunk(
            len(routed), 4 * sum(w.in_features * w.out_features for w in (routed[0].w1, routed[0].w2, routed[0].w3)),
            chunk_bytes)
        groups = [routed[i:i + self.per_chunk] for i in range(0, len(routed), self.per_chunk)]
        self.routed_up = StoredStack("experts.w13", [[m.stored for e in g for m in (e.w1, e.w3)] for g in groups], 0)
        self.routed_down = StoredStack("experts.w2", [[e.w2.stored for e in g] for g in groups], 1)
        shared = moe.shared_experts
        self.shared_up = StoredMatrix.concatenated("shared_experts.w13", [shared.w1.stored, shared.w3.stored], 0)
        self.shared_down = shared.w2.stored
        self.gate_weight = moe.gate.weight
        self.gate_bias = moe.gate.bias
        self.topk, self.route_scale = moe.gate.topk, moe.gate.route_scale
        for e in experts:  # the stacks now hold the bytes; drop the per-expert copies
            for proj in ("w1", "w2", "w3"):
                getattr(e, proj).stored = None
        release_free_heap()

    @property
    def chunk_count(self) -> int:
        """Routed chunks (the shared expert is one more weight)."""
        return len(self.routed_up)

    def up(self, xq: torch.Tensor) -> torch.Tensor:
        routed = self.routed_up.products(xq)  # (C, ..., per_chunk * 2I)
        routed = routed.movedim(0, -2).flatten(-2)  # (..., C * per_chunk * 2I): chunk by chunk, as the dense columns
        return torch.cat((routed, xq @ self.shared_up.value().t()), -1)

    def down(self, aq: torch.Tensor) -> torch.Tensor:
        width = self.per_chunk * self.inter
        routed, shared = aq[..., :self.chunk_count * width], aq[..., self.chunk_count * width:]
        total = self.routed_down.summed(routed.unflatten(-1, (self.chunk_count, width)).movedim(-2, 0))
        return total + shared @ self.shared_down.value().t()

    def chunks(self) -> list[nn.Module]:
        """The stored weights, to register on the step module (so the exporter sees their buffers as weights)."""
        return [self.routed_up, self.routed_down, self.shared_up, self.shared_down]


def experts_per_chunk(routed: int, expert_bytes: int, chunk_bytes: int) -> int:
    """Routed experts per chunk: the most whose fp32 weights (`expert_bytes` each) fit in `chunk_bytes`, at least one,
    lowered to a divisor of `routed` so every chunk of the stack has the same shape (256 experts: 1, 2, 4, 8, ...)."""
    most = max(1, min(routed, chunk_bytes // expert_bytes))
    return max(d for d in range(1, most + 1) if routed % d == 0)


def head_logits(x: torch.Tensor, weight: torch.Tensor, chunk_bytes: int = EXPERT_CHUNK_BYTES) -> torch.Tensor:
    """`x @ weight.T` in fp32. A weight stored narrower (the release's bf16 head: 129280 x 4096) is cast in chunks of
    vocabulary rows of at most `chunk_bytes` of fp32, each only while it multiplies. Why: cast whole, the head is a
    2.1 GB fp32 transient at full size, twice its stored bytes, in the export, the graph and the check alike; an fp32
    head is used as it is (no copy, and the default's graphs are unchanged)."""
    if weight.dtype == torch.float32:
        return x @ weight.t()
    rows = max(1, chunk_bytes // (4 * weight.shape[1]))
    if rows >= weight.shape[0]:
        return x @ weight.float().t()
    return torch.cat([x @ weight[i:i + rows].float().t() for i in range(0, weight.shape[0], rows)], -1)


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc `malloc_trim`; a no-op elsewhere). Why: the per-expert
    tensors a chunk was joined from are small at reduced widths (kilobytes: heap allocations, not mappings of their
    own), so once freed their pages would stay resident beside the chunk, a second copy of the experts' bytes in RSS.
    At the release's width each is megabytes, its own mapping, and leaves RSS when freed without this."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def expert_chunk_bytes() -> int:
    """The chunk budget of this build: `MOL2_EXPERT_CHUNK_BYTES` when set (a spawned build worker inherits it), else
    `EXPERT_CHUNK_BYTES`."""
    value = os.environ.get(EXPERT_CHUNK_ENV)
    if value is None:
        return EXPERT_CHUNK_BYTES
    if not value.isdigit() or int(value) < 1:
        raise StoredWeightError(f"{EXPERT_CHUNK_ENV}={value!r}: expected a positive number of bytes")
    return int(value)


def experts_for(moe: MoE) -> DenseExperts:
    """The step's experts of one MoE: `StoredExperts` when its projections stay stored, else `DenseExperts`."""
    # an expert-parallel rank may hold no shared expert
    stored = isinstance(getattr(moe.shared_experts, "w1", None), StoredLinear)
    return StoredExperts(moe, expert_chunk_bytes()) if stored else DenseExperts(moe)


def stored_chunks(experts: dict[int, DenseExperts]) -> nn.ModuleList:
    """Every stored expert chunk of a step (none for dense experts), as one registered list."""
    return nn.ModuleList([m for e in experts.values() if isinstance(e, StoredExperts) for m in e.chunks()])


def store_linears(component: nn.Module, stored: Callable[[str], tuple[torch.Tensor, torch.Tensor | None]],
                  names: set[str]) -> None:
    """Replace each Linear of `component` whose weight is in `names` by a `StoredLinear` over `stored(weight name)`
    (the stored tensor and its scale)."""
    for module_name, module in list(component.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{module_name}.{child_name}" if module_name else child_name
            if isinstance(child, nn.Linear) and f"{full}.weight" in names:
                if child.bias is not None:
                    raise StoredWeightError(f"{full}: a stored Linear with a bias is not supported")
                tensor, scale = stored(f"{full}.weight")
                matrix = StoredMatrix.from_stored(f"{full}.weight", tensor, scale,
                                                  (child.out_features, child.in_features))
                setattr(module, child_name, StoredLinear(matrix, bool(getattr(child, "quantize_input", False))))
