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

from build_engines.formats.quant_formats import E2M1_VALUES, QuantFormatError, infer_block_dim
from build_engines.model.moe import MoE
from build_engines.model.primitives import ACT_QUANT_BLOCK

from .graph_ops import DenseExperts, fp8_qdq

FP4_BLOCK = 32  # ue8m0 scale per 32 values along K (release format)
EXPERT_CHUNK_BYTES = 16 << 20  # fp32 weights one MoE chunk dequantizes at once (at least one expert): see StoredExperts
EXPERT_CHUNK_ENV = "MOL2_EXPERT_CHUNK_BYTES"  # overrides it (`python -m build_engines build --expert-chunk-bytes N`)

_CODES = torch.arange(256, dtype=torch.uint8)
E4M3_TABLE = _CODES.view(torch.float8_e4m3fn).float()  # code -> value (0x7F / 0xFF: NaN, as the cast)
E8M0_TABLE = _CODES.view(torch.float8_e8m0fnu).float()  # code -> 2^(code - 127) (0xFF: NaN)
FP4_PAIR_TABLE = torch.stack((E2M1_VALUES.float()[(_CODES & 0x0F).long()], E2M1_VALUES.float()[(_CODES >> 4).long()]), -1)

KINDS = ("fp8", "fp4", "float")


class StoredWeightError(ValueError):
    """A stored tensor does not fit the weight it stands for; the message names it."""


class StoredMatrix(nn.Module):
    """One [out, in] weight as stored: `codes` (uint8 fp8 codes, uint8 packed fp4 pairs, or the float tensor itself)
    and `scale` (uint8 e8m0 codes; empty for floats). `value()` is the fp32 weight, in exportable ops."""

    def __init__(self, name: str, kind: str, codes: torch.Tensor, scale: torch.Tensor | None, shape: tuple[int, int]) -> None:
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
            if tuple(codes.shape) != (out, inn // 2) or scale is None or tuple(scale.shape) != (out, math.ceil(inn / FP4_BLOCK)):
                raise StoredWeightError(f"{name}: packed fp4 codes {tuple(codes.shape)} / scale do not fit {shape} "
                                        f"(one e8m0 scale per {FP4_BLOCK} along in)")
            self.block = (1, FP4_BLOCK)
        else:
            if tuple(codes.shape) != shape:
                raise StoredWeightError(f"{name}: stored shape {tuple(codes.shape)} is not {shape}")
            self.block = (1, 1)

    @classmethod
    def from_stored(cls, name: str, stored: torch.Tensor, scale: torch.Tensor | None, shape: tuple[int, int]) -> "StoredMatrix":
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
        out, inn = self.shape
        if self.kind == "float":
            return self.codes.float()
        scale = E8M0_TABLE.to(self.codes.device)[self.scale.long()]
        if self.kind == "fp4":
            values = FP4_PAIR_TABLE.to(self.codes.device)[self.codes.long()].reshape(out, -1, FP4_BLOCK)
            return (values * scale.unsqueeze(-1)).reshape(out, -1)[:, :inn]
        b0, b1 = self.block
        values = E4M3_TABLE.to(self.codes.device)[self.codes.long()]
        full = scale.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inn]
        return values * full

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


class StoredExperts(DenseExperts):
    """`DenseExperts` on stored weights: the same column layout ([expert g][w1 | w3][inter], shared expert last), the
    products taken over chunks of experts whose fp32 weights fit in `chunk_bytes` (at least one expert per chunk),
    each chunk dequantized only while it multiplies.

    Why chunks: one layer's routed experts dequantized at once would be ~8x their packed-fp4 bytes (at full size
    256 x 100 MB = 25.8 GB per layer); a chunk bounds that transient to a fixed size (a full-size expert alone is
    100 MB, so there a chunk is one expert), whatever the model's width or expert count. Experts
    of one chunk share a storage kind (the release: routed fp4, shared fp8), so the shared expert is a chunk of its
    own. The up-projection concatenates the chunks' columns (the dense layout, so routing and LoRA are unchanged); the
    down-projection sums the chunks' partial products (in chunk order: the graph and the module sum alike)."""

    def __init__(self, moe: MoE, chunk_bytes: int = EXPERT_CHUNK_BYTES) -> None:  # noqa: D107
        routed = list(moe.experts)
        experts = routed + [moe.shared_experts]
        if not all(isinstance(w, StoredLinear) for e in experts for w in (e.w1, e.w2, e.w3)):
            raise StoredWeightError("StoredExperts needs every expert projection stored (StoredLinear)")
        self.count = len(experts)
        self.inter = experts[0].w1.out_features
        if any(e.w1.out_features != self.inter for e in experts):
            raise StoredWeightError("dense experts need one intermediate width for routed and shared experts")
        self.limit = experts[0].limit
        quant = {w.quantize_input for e in experts for w in (e.w1, e.w2, e.w3)}
        if len(quant) != 1:
            raise StoredWeightError("dense experts need every expert projection quantized alike")
        self.quantize_input = quant.pop()
        per_expert = 4 * sum(w.in_features * w.out_features for w in (routed[0].w1, routed[0].w2, routed[0].w3)) if routed else 1
        chunk = max(1, chunk_bytes // per_expert)
        groups = [routed[i:i + chunk] for i in range(0, len(routed), chunk)] + [[moe.shared_experts]]
        self.up_chunks = [StoredMatrix.concatenated("experts.w13", [m.stored for e in g for m in (e.w1, e.w3)], 0) for g in groups]
        self.down_chunks = [StoredMatrix.concatenated("experts.w2", [e.w2.stored for e in g], 1) for g in groups]
        self.chunk_widths = [len(g) * self.inter for g in groups]
        self.gate_weight = moe.gate.weight
        self.gate_bias = moe.gate.bias
        self.topk, self.route_scale = moe.gate.topk, moe.gate.route_scale
        for e in experts:  # the chunks now hold the bytes; drop the per-expert copies
            for proj in ("w1", "w2", "w3"):
                getattr(e, proj).stored = None
        release_free_heap()

    def up(self, xq: torch.Tensor) -> torch.Tensor:
        return torch.cat([xq @ m.value().t() for m in self.up_chunks], -1)

    def down(self, aq: torch.Tensor) -> torch.Tensor:
        parts = torch.split(aq, self.chunk_widths, -1)
        total = parts[0] @ self.down_chunks[0].value().t()
        for part, m in zip(parts[1:], self.down_chunks[1:]):
            total = total + part @ m.value().t()
        return total

    def chunks(self) -> list[nn.Module]:
        """The chunks, to register on the step module (so the exporter sees their buffers as weights)."""
        return [*self.up_chunks, *self.down_chunks]


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
    return StoredExperts(moe, expert_chunk_bytes()) if isinstance(moe.shared_experts.w1, StoredLinear) else DenseExperts(moe)


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
                matrix = StoredMatrix.from_stored(f"{full}.weight", tensor, scale, (child.out_features, child.in_features))
                setattr(module, child_name, StoredLinear(matrix, bool(getattr(child, "quantize_input", False))))
