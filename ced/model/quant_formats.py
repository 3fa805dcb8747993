"""Low-precision weight formats of the DeepSeek-V4.1-Flash release, and its runtime fake-quant.

Two jobs live here, and they share their arithmetic on purpose:

1. **Reading (and writing) released checkpoints.**

   * fp8 weights: ``torch.float8_e4m3fn`` of shape ``[out, in]`` with a companion
     ``torch.float8_e8m0fnu`` ("ue8m0", pure power of two) scale of shape
     ``[ceil(out/b0), ceil(in/b1)]``; each ``b0 x b1`` block of the weight is multiplied by
     its scale. V4.1-Flash uses 32x32 blocks, V4-Flash used 128x128, so the block size is
     either passed explicitly or inferred from the shapes (see
     :func:`dequantize_fp8_blocks`).
   * packed fp4 expert weights: ``torch.int8`` of shape ``[out, in/2]``; each byte holds two
     E2M1 codes, the LOW nibble is logical element ``2k`` and the HIGH nibble element
     ``2k+1``. The scale is ``float8_e8m0fnu`` of shape ``[out, in/32]``: one power of two per
     32 consecutive logical elements along ``in``.

   The ``quantize_*`` writers exist so tests and tools can produce synthetic checkpoints in
   exactly the release layout; they use the same scale rule as the runtime fake-quant, so
   ``dequantize(quantize(w))`` equals the matching QDQ function bit for bit.

2. **Reproducing the runtime QAT fake-quant** ("QDQ": quantize then immediately dequantize,
   along the last dimension): :func:`fp8_qdq`, :func:`fp4_qdq_ue8m0`, :func:`fp4_qdq_e4m3`.

Numerical choices (why they are what they are):

* All arithmetic is done in float32 whatever the input dtype, because that is what the
  reference kernels do; outputs are cast back to the input dtype (or ``out_dtype``).
* Power-of-two scales are ``2^ceil(log2(amax / qmax))``. ``ceil(log2(.))`` is computed
  exactly from the float's exponent/mantissa (``torch.frexp``), not with ``torch.log2``,
  because ``log2`` of values just above a power of two can round down and pick a scale one
  binade too small (the reference kernels also work on the bits). Exponents are clamped to
  the e8m0 range ``[-127, 127]`` (code 255 is NaN).
* Rounding to E2M1 is round-to-nearest with ties to the even *code* (i.e. to the value
  whose mantissa bit is 0), which is IEEE round-half-to-even for this format and what
  hardware ``cvt.rn.satfinite.e2m1`` does: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0,
  2.5->2.0, 3.5->4.0, 5.0->4.0. Magnitudes above 6 saturate to 6.
* Rounding to E4M3 uses torch's cast (round-to-nearest-even) after an explicit clamp to
  +-448, so behaviour does not depend on how a torch version treats out-of-range casts.
* Zero keeps its sign on the way through (``-tiny`` may come back as ``-0.0``, code 8).
  NaN inputs are not supported: their output is unspecified.

Every function validates dtypes and shapes and raises :class:`QuantFormatError` (a
``ValueError``) whose message states the expected and the actual value; callers are
expected to prefix the tensor name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "E2M1_VALUES",
    "E2M1_MAX",
    "E4M3_MAX",
    "QuantFormatError",
    "dequantize_fp8_blocks",
    "quantize_fp8_blocks",
    "unpack_fp4",
    "pack_fp4",
    "dequantize_fp4_packed",
    "quantize_fp4_packed",
    "fp8_qdq",
    "fp4_qdq_ue8m0",
    "fp4_qdq_e4m3",
]


class QuantFormatError(ValueError):
    """Bad dtype/shape/value for a quantized format.

    A ``ValueError`` subclass so callers can catch either; a distinct type so a loader can
    tell format problems apart from unrelated ``ValueError``s.
    """


#: E2M1 (fp4) value of each 4-bit code. Bit 3 is the sign, so codes 8..15 are the negatives
#: of codes 0..7 (code 8 is -0.0).
E2M1_VALUES: Tensor = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
#: Largest E2M1 magnitude.
E2M1_MAX: float = 6.0
#: Largest finite float8_e4m3fn magnitude.
E4M3_MAX: float = 448.0

# Midpoints between consecutive E2M1 magnitudes; index j separates code j from code j+1.
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)

# Amax floors from the reference recipes. They keep all-zero blocks from producing a zero
# (or denormal-underflowing) scale and a 0/0 division.
_FP8_AMAX_FLOOR = 1e-4
_FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126  # => scale exponent >= -126
_FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9  # => scale >= smallest e4m3 subnormal (2^-9)

_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127
_E8M0_BIAS = 127
_E8M0_NAN_CODE = 255

_FP4_PACKED_DTYPES: tuple[torch.dtype, ...] = (torch.int8, torch.uint8) + (
    (torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ()
)
_FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}


# ----------------------------------------------------------------------------- validation


def _shape(t: Tensor | Sequence[int]) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, Tensor) else tuple(t)


def _check_tensor(x: object, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise QuantFormatError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _check_dtype(x: Tensor, allowed: Sequence[torch.dtype], what: str) -> None:
    if x.dtype not in allowed:
        exp = allowed[0] if len(allowed) == 1 else " or ".join(str(d) for d in allowed)
        raise QuantFormatError(f"{what}: expected dtype {exp}, got {x.dtype} (shape {_shape(x)})")


def _check_float_input(x: Tensor, what: str) -> None:
    """High-precision inputs only: quantizing an already-quantized or integer tensor is a bug."""
    if not x.is_floating_point() or x.dtype in _FP8_DTYPES or x.dtype == torch.float8_e8m0fnu:
        raise QuantFormatError(
            f"{what}: expected a float32/bfloat16/float16/float64 tensor, got dtype {x.dtype} "
            f"(shape {_shape(x)})"
        )


def _check_positive_int(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise QuantFormatError(f"{what}: expected a positive int, got {v!r}")
    return v


def _check_block_pair(block: object, what: str) -> tuple[int, int]:
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise QuantFormatError(f"{what}: expected a (rows, cols) pair of positive ints, got {block!r}")
    return (_check_positive_int(block[0], f"{what}[0]"), _check_positive_int(block[1], f"{what}[1]"))


def _check_last_dim_divisible(x: Tensor, block: int, what: str) -> None:
    if x.ndim == 0:
        raise QuantFormatError(f"{what}: expected at least 1 dimension, got a 0-d tensor")
    n = x.shape[-1]
    if n % block != 0:
        raise QuantFormatError(
            f"{what}: last dimension {n} (shape {_shape(x)}) is not divisible by the block size "
            f"{block}; expected a multiple of {block} (e.g. {math.ceil(n / block) * block})"
        )


def _check_e8m0_finite(scale: Tensor, what: str) -> None:
    if scale.numel() and bool(scale.view(torch.uint8).eq(_E8M0_NAN_CODE).any()):
        raise QuantFormatError(f"{what}: float8_e8m0fnu scale contains the NaN code 0xFF")


# ----------------------------------------------------------------------------- scale helpers


def _ceil_log2(v: Tensor) -> Tensor:
    """Exact ``ceil(log2(v))`` for positive finite float32 ``v``, as int32.

    ``frexp`` gives ``v = m * 2^e`` with ``m`` in ``[0.5, 1)``; ``v`` is a power of two exactly
    when ``m == 0.5`` (then ``log2 v = e - 1``), otherwise ``ceil(log2 v) = e``. Working on the
    representation avoids ``log2`` rounding error at binade edges.
    """
    mant, exp = torch.frexp(v)
    return torch.where(mant == 0.5, exp - 1, exp)


def _e8m0_exponent(amax: Tensor, qmax: float) -> Tensor:
    """Power-of-two scale exponent ``ceil(log2(amax/qmax))`` clamped to the e8m0 range."""
    return _ceil_log2(amax / qmax).clamp_(_E8M0_MIN_EXP, _E8M0_MAX_EXP)


def _e8m0_from_exponent(exp: Tensor) -> Tensor:
    """Encode int exponents (already in ``[-127, 127]``) as ``float8_e8m0fnu`` (biased by 127)."""
    return (exp + _E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2(exp: Tensor) -> Tensor:
    """``2^exp`` as float32, exact over the whole e8m0 range (including subnormal 2^-127)."""
    return torch.ldexp(torch.ones(exp.shape, dtype=torch.float32, device=exp.device), exp)


def _blocked(x: Tensor, block: int) -> Tensor:
    """View ``[..., n]`` as ``[..., n/block, block]`` (caller has checked divisibility)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


# ----------------------------------------------------------------------------- E2M1 rounding


def _e2m1_magnitude_codes(a: Tensor) -> Tensor:
    """Round non-negative float32 magnitudes to E2M1 codes 0..7 (uint8), ties to even code.

    ``bucketize`` (``right=False``) counts the midpoints strictly below ``a``, i.e. rounds
    every tie down; a tie on midpoint ``j`` with odd ``j`` must instead go up to the even code
    ``j+1``. Anything above 5 maps to code 7 (6.0), which is the saturating behaviour.
    """
    mids = _E2M1_MIDPOINTS.to(a.device)
    code = torch.bucketize(a, mids, right=False)
    mids_ext = torch.cat([mids, mids.new_tensor([math.inf])])
    tie_up = (code % 2 == 1) & (a == mids_ext[code])
    return (code + tie_up.to(code.dtype)).to(torch.uint8)


def _e2m1_codes(values: Tensor) -> Tensor:
    """Signed E2M1 codes 0..15 (uint8) for float32 ``values`` already divided by their scale."""
    mag = _e2m1_magnitude_codes(values.abs())
    neg = torch.signbit(values).to(torch.uint8) << 3
    return mag | neg


def _fp4_ue8m0_quantize(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Shared core of :func:`fp4_qdq_ue8m0` and :func:`quantize_fp4_packed`.

    Returns ``(codes uint8 [..., n], exponents int32 [..., n/block])`` for ``x`` whose last dim
    is a multiple of ``block``.
    """
    xb = _blocked(x.to(torch.float32), block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(_FP4_UE8M0_AMAX_FLOOR)
    exp = _e8m0_exponent(amax, E2M1_MAX)
    codes = _e2m1_codes(xb / _pow2(exp))
    return codes.reshape(x.shape), exp.squeeze(-1)


# ----------------------------------------------------------------------------- runtime QDQ


def fp8_qdq(x: Tensor, block: int = 32) -> Tensor:
    """Fake-quantize to fp8 e4m3 with one ue8m0 (power-of-two) scale per ``block`` values.

    Per block along the last dim: ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``, then
    ``float(fp8(clamp(x / scale, -448, 448))) * scale``. The power-of-two scale makes the
    division and re-multiplication exact, so the only error is the e4m3 rounding: at most
    ``2^-4`` relative to the element for normal e4m3 values, and at most ``2^-10 * scale`` for
    elements that land in the e4m3 subnormal range.

    Raises :class:`QuantFormatError` if ``x`` is not a high-precision float tensor or its last
    dim is not a multiple of ``block``. Output has ``x``'s dtype and shape.
    """
    x = _check_tensor(x, "fp8_qdq input")
    block = _check_positive_int(block, "fp8_qdq block")
    _check_float_input(x, "fp8_qdq input")
    _check_last_dim_divisible(x, block, "fp8_qdq input")
    xb = _blocked(x.to(torch.float32), block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(_FP8_AMAX_FLOOR)
    scale = _pow2(_e8m0_exponent(amax, E4M3_MAX))
    q = (xb / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return (q * scale).reshape(x.shape).to(x.dtype)


def fp4_qdq_ue8m0(x: Tensor, block: int = 32) -> Tensor:
    """Fake-quantize to fp4 e2m1 with one ue8m0 (power-of-two) scale per ``block`` values.

    Per block along the last dim: ``scale = 2^ceil(log2(max(amax, 6*2^-126) / 6))`` (so
    ``|x / scale| <= 6``), values ``x / scale`` rounded to the nearest E2M1 value with ties to
    the even code, times ``scale``. This is the same arithmetic as
    ``dequantize_fp4_packed(*quantize_fp4_packed(x))``.

    Raises :class:`QuantFormatError` on a non-float input or a last dim not divisible by
    ``block``. Output has ``x``'s dtype and shape.
    """
    x = _check_tensor(x, "fp4_qdq_ue8m0 input")
    block = _check_positive_int(block, "fp4_qdq_ue8m0 block")
    _check_float_input(x, "fp4_qdq_ue8m0 input")
    _check_last_dim_divisible(x, block, "fp4_qdq_ue8m0 input")
    codes, exp = _fp4_ue8m0_quantize(x, block)
    vals = E2M1_VALUES.to(x.device)[codes.long()]
    out = _blocked(vals, block) * _pow2(exp).unsqueeze(-1)
    return out.reshape(x.shape).to(x.dtype)


def fp4_qdq_e4m3(x: Tensor, block: int = 16) -> Tensor:
    """Fake-quantize to fp4 e2m1 with one E4M3 scale per ``block`` values (no global scale).

    NVFP4-style but without the per-tensor fp32 scale. Per block along the last dim:
    ``scale = fp8_e4m3(min(max(amax, 6*2^-9) / 6, 448))`` (the scale itself is rounded to
    e4m3, RNE), then ``x / scale`` rounded to E2M1 (ties to even code, saturating at 6 because
    the rounded scale can be slightly below ``amax/6``), times that rounded scale.

    Raises :class:`QuantFormatError` on a non-float input or a last dim not divisible by
    ``block``. Output has ``x``'s dtype and shape.
    """
    x = _check_tensor(x, "fp4_qdq_e4m3 input")
    block = _check_positive_int(block, "fp4_qdq_e4m3 block")
    _check_float_input(x, "fp4_qdq_e4m3 input")
    _check_last_dim_divisible(x, block, "fp4_qdq_e4m3 input")
    xb = _blocked(x.to(torch.float32), block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(_FP4_E4M3_AMAX_FLOOR)
    scale = (amax / E2M1_MAX).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    codes = _e2m1_codes(xb / scale)
    out = E2M1_VALUES.to(x.device)[codes.long()] * scale
    return out.reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------- fp8 blocks


def infer_block_dim(n: int, nblocks: int, axis: str) -> int:
    """Infer one block extent from a dimension ``n`` and its scale count ``nblocks``.

    Every ``b`` with ``ceil(n / b) == nblocks`` is consistent with the shapes, and when ``n``
    is not a multiple of the true block several are (e.g. 100 rows in 4 scale rows fits 25..33),
    and they map rows to scales differently. So: a single scale row/col means any ``b >= n``
    (all equivalent); otherwise prefer the power of two in the consistent range (release block
    sizes are 32 and 128; the range spans less than a factor 2, so there is at most one), then
    the exact divisor ``n / nblocks``; otherwise refuse and ask for an explicit block.
    """
    if nblocks <= 0 or nblocks > n:
        raise QuantFormatError(
            f"cannot infer the {axis} block size: weight {axis} dim {n} vs {nblocks} scale "
            f"{axis}s; expected between 1 and {n} scale {axis}s"
        )
    if nblocks == 1:
        return n
    lo = math.ceil(n / nblocks)
    hi = math.ceil(n / (nblocks - 1)) - 1  # largest b with ceil(n / b) == nblocks
    if lo > hi:  # cannot happen for 1 < nblocks <= n, kept as a guard
        raise QuantFormatError(f"no {axis} block size maps {n} to {nblocks} scale {axis}s")
    p2 = 1 << (hi.bit_length() - 1)  # largest power of two <= hi
    if p2 >= lo:
        return p2
    if n % nblocks == 0:
        return n // nblocks
    raise QuantFormatError(
        f"ambiguous {axis} block size: weight {axis} dim {n} with {nblocks} scale {axis}s fits "
        f"any block in [{lo}, {hi}]; pass block= explicitly"
    )


def dequantize_fp8_blocks(
    weight: Tensor,
    scale: Tensor,
    block: tuple[int, int] | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Dequantize a block-scaled fp8 weight: ``out[i, j] = w[i, j] * scale[i // b0, j // b1]``.

    ``weight``: ``float8_e4m3fn`` ``[..., out, in]``; ``scale``: ``float8_e8m0fnu``
    ``[..., ceil(out/b0), ceil(in/b1)]`` with the same leading dims (stacked experts work).
    Partial edge blocks are allowed, as in the release format.

    ``block=None`` infers ``(b0, b1)`` from the shapes (see :func:`infer_block_dim`; exact
    for the release's multiples of 32/128). Passing ``block`` is preferred when known: the
    scale shape is then checked against it, which catches a checkpoint with a different block
    size (e.g. V4-Flash's 128x128 vs V4.1's 32x32) instead of silently mis-scaling.

    The product of an e4m3 value and a power of two is exact in float32 (and in bf16 barring
    range limits), so the result does not depend on evaluation order.
    """
    weight = _check_tensor(weight, "fp8 weight")
    scale = _check_tensor(scale, "fp8 scale")
    _check_dtype(weight, (torch.float8_e4m3fn,), "fp8 weight")
    _check_dtype(scale, (torch.float8_e8m0fnu,), "fp8 scale")
    if weight.ndim < 2:
        raise QuantFormatError(f"fp8 weight: expected shape [..., out, in], got {_shape(weight)}")
    if scale.ndim != weight.ndim or scale.shape[:-2] != weight.shape[:-2]:
        raise QuantFormatError(
            f"fp8 scale: expected shape [{', '.join(map(str, weight.shape[:-2]))}"
            f"{', ' if weight.ndim > 2 else ''}rows, cols] matching weight {_shape(weight)}, "
            f"got {_shape(scale)}"
        )
    n_out, n_in = weight.shape[-2], weight.shape[-1]
    s_rows, s_cols = scale.shape[-2], scale.shape[-1]
    if block is None:
        b0 = infer_block_dim(n_out, s_rows, "row")
        b1 = infer_block_dim(n_in, s_cols, "col")
    else:
        b0, b1 = _check_block_pair(block, "fp8 block")
        expected = (math.ceil(n_out / b0), math.ceil(n_in / b1))
        if (s_rows, s_cols) != expected:
            raise QuantFormatError(
                f"fp8 scale: expected shape {(*weight.shape[:-2], *expected)} for weight shape "
                f"{_shape(weight)} with block {(b0, b1)}, got {_shape(scale)}"
            )
    _check_e8m0_finite(scale, "fp8 scale")
    s = scale.to(torch.float32)
    s = s.repeat_interleave(b0, dim=-2)[..., :n_out, :].repeat_interleave(b1, dim=-1)[..., :n_in]
    return (weight.to(torch.float32) * s).to(out_dtype)


def quantize_fp8_blocks(weight: Tensor, block: tuple[int, int] = (32, 32)) -> tuple[Tensor, Tensor]:
    """Quantize a float weight ``[..., out, in]`` to the release fp8 block format.

    Returns ``(float8_e4m3fn [..., out, in], float8_e8m0fnu [..., ceil(out/b0), ceil(in/b1)])``
    with ``scale = 2^ceil(log2(max(block_amax, 1e-4) / 448))`` per 2-D block (partial edge
    blocks allowed). Meant for synthetic checkpoints: with ``block=(1, k)`` the round trip
    equals :func:`fp8_qdq` with ``block=k``.
    """
    weight = _check_tensor(weight, "fp8 quantize input")
    _check_float_input(weight, "fp8 quantize input")
    b0, b1 = _check_block_pair(block, "fp8 block")
    if weight.ndim < 2:
        raise QuantFormatError(f"fp8 quantize input: expected shape [..., out, in], got {_shape(weight)}")
    n_out, n_in = weight.shape[-2], weight.shape[-1]
    r, c = math.ceil(n_out / b0), math.ceil(n_in / b1)
    w = weight.to(torch.float32)
    # Zero padding cannot raise a block's amax, so edge blocks get the scale of their real values.
    w = torch.nn.functional.pad(w, (0, c * b1 - n_in, 0, r * b0 - n_out))
    wb = w.reshape(*w.shape[:-2], r, b0, c, b1)
    amax = wb.abs().amax(dim=(-3, -1)).clamp_min(_FP8_AMAX_FLOOR)  # [..., r, c]
    exp = _e8m0_exponent(amax, E4M3_MAX)
    s = _pow2(exp)[..., :, None, :, None]
    q = (wb / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(w.shape)[..., :n_out, :n_in].contiguous()
    return q, _e8m0_from_exponent(exp)


# ----------------------------------------------------------------------------- packed fp4


def _packed_bytes(packed: Tensor, what: str) -> Tensor:
    _check_dtype(packed, _FP4_PACKED_DTYPES, what)
    if packed.ndim == 0:
        raise QuantFormatError(f"{what}: expected shape [..., n/2], got a 0-d tensor")
    return packed.view(torch.uint8)


def _unpack_codes(packed_u8: Tensor) -> Tensor:
    """uint8 ``[..., m]`` -> E2M1 codes uint8 ``[..., 2m]``; low nibble first (element 2k)."""
    low = packed_u8 & 0x0F
    high = packed_u8 >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed_u8.shape[:-1], packed_u8.shape[-1] * 2)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Unpack E2M1 pairs: ``int8 [..., n/2]`` -> ``float32 [..., n]`` (unscaled values).

    Byte ``k`` holds element ``2k`` in its low nibble and ``2k+1`` in its high nibble. ``uint8``
    and ``torch.float4_e2m1fn_x2`` (same bytes) are accepted as well as the release's ``int8``.
    """
    packed = _check_tensor(packed, "packed fp4")
    codes = _unpack_codes(_packed_bytes(packed, "packed fp4"))
    return E2M1_VALUES.to(packed.device)[codes.long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack E2M1 codes (integers 0..15) ``[..., n]`` into ``int8 [..., n/2]``, low nibble first.

    Inverse of the byte layout read by :func:`unpack_fp4`. Raises if ``codes`` is not an
    integer tensor, ``n`` is odd, or a code is outside ``0..15`` (which would silently corrupt
    the neighbouring nibble).
    """
    codes = _check_tensor(codes, "fp4 codes")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise QuantFormatError(f"fp4 codes: expected an integer dtype (e.g. torch.uint8), got {codes.dtype}")
    _check_last_dim_divisible(codes, 2, "fp4 codes")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise QuantFormatError(
            f"fp4 codes: expected values in [0, 15], got range [{int(codes.min())}, {int(codes.max())}]"
        )
    c = codes.to(torch.uint8)
    pairs = c.reshape(*c.shape[:-1], c.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def dequantize_fp4_packed(
    packed: Tensor,
    scale: Tensor,
    block: int = 32,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Dequantize packed fp4: ``out[..., j] = e2m1(packed)[..., j] * scale[..., j // block]``.

    ``packed``: ``int8 [..., n/2]`` (see :func:`unpack_fp4`); ``scale``: ``float8_e8m0fnu``
    ``[..., ceil(n/block)]`` with the same leading dims. The shape check against ``block``
    is what catches a checkpoint whose scale granularity differs from the one assumed.
    """
    packed = _check_tensor(packed, "packed fp4")
    scale = _check_tensor(scale, "fp4 scale")
    block = _check_positive_int(block, "fp4 block")
    u8 = _packed_bytes(packed, "packed fp4")
    _check_dtype(scale, (torch.float8_e8m0fnu,), "fp4 scale")
    n = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], math.ceil(n / block))
    if _shape(scale) != expected:
        raise QuantFormatError(
            f"fp4 scale: expected shape {expected} for packed shape {_shape(packed)} "
            f"({n} logical values per row, block {block}), got {_shape(scale)}"
        )
    _check_e8m0_finite(scale, "fp4 scale")
    vals = E2M1_VALUES.to(packed.device)[_unpack_codes(u8).long()]
    s = scale.to(torch.float32).repeat_interleave(block, dim=-1)[..., :n]
    return (vals * s).to(out_dtype)


def quantize_fp4_packed(weight: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Quantize a float weight ``[..., n]`` to the release packed-fp4 format.

    Returns ``(int8 [..., n/2], float8_e8m0fnu [..., ceil(n/block)])`` using exactly the
    arithmetic of :func:`fp4_qdq_ue8m0`, so the round trip equals that QDQ. ``n`` must be even
    (two values per byte); a partial last block is zero-padded for its amax.
    """
    weight = _check_tensor(weight, "fp4 quantize input")
    block = _check_positive_int(block, "fp4 block")
    _check_float_input(weight, "fp4 quantize input")
    _check_last_dim_divisible(weight, 2, "fp4 quantize input")
    n = weight.shape[-1]
    padded = torch.nn.functional.pad(weight.to(torch.float32), (0, math.ceil(n / block) * block - n))
    codes, exp = _fp4_ue8m0_quantize(padded, block)
    return pack_fp4(codes[..., :n]), _e8m0_from_exponent(exp)
