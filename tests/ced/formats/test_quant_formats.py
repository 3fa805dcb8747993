"""Tests for ced.model.quant_formats: release checkpoint formats and runtime fake-quant.

Expected values in the hand-computed tests are written out literally (not recomputed with the
code under test), so a wrong nibble order, scale layout or rounding rule shows up as a plain
number mismatch.
"""

from __future__ import annotations

import math

import pytest
import torch

from ced.model.quant_formats import (
    E2M1_VALUES,
    QuantFormatError,
    dequantize_fp4_packed,
    dequantize_fp8_blocks,
    fp4_qdq_e4m3,
    fp4_qdq_ue8m0,
    fp8_qdq,
    pack_fp4,
    quantize_fp4_packed,
    quantize_fp8_blocks,
    unpack_fp4,
)


def e8m0(exponents: list | torch.Tensor) -> torch.Tensor:
    """Build an e8m0 scale tensor from integer exponents via its bits (bias 127)."""
    e = torch.as_tensor(exponents, dtype=torch.int32)
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def block_pow2_scale(x: torch.Tensor, block: int, qmax: float, floor: float) -> torch.Tensor:
    """Reference per-block ue8m0 scale in float64 with math.log2 (independent of the module)."""
    amax = x.double().reshape(*x.shape[:-1], -1, block).abs().amax(-1).clamp_min(floor)
    return torch.tensor([2.0 ** math.ceil(math.log2(v / qmax)) for v in amax.flatten().tolist()],
                        dtype=torch.float64).reshape(amax.shape)


POS_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def nearest_e2m1_distance(v: torch.Tensor) -> torch.Tensor:
    """Distance from each |v| to its nearest E2M1 magnitude (saturating at 6)."""
    return (v.double().abs().unsqueeze(-1) - POS_E2M1).abs().amin(-1)


# ----------------------------------------------------------------------------- E2M1 table


def test_e2m1_table():
    assert E2M1_VALUES.dtype == torch.float32 and E2M1_VALUES.shape == (16,)
    assert E2M1_VALUES.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(E2M1_VALUES[8])  # code 8 is -0


# ----------------------------------------------------------------------------- fp8 blocks


def test_dequantize_fp8_two_blocks_hand_computed():
    w = torch.zeros(2, 64)
    w[0, 0] = 1.5
    w[0, 31] = -448.0
    w[0, 32] = 0.5
    w[1, 5] = 2.0**-9  # smallest e4m3 subnormal
    w[1, 40] = 240.0
    w[1, 63] = -3.25
    scale = e8m0([[-3, 2]])  # block (32, 32): cols 0..31 x 2^-3, cols 32..63 x 2^2
    out = dequantize_fp8_blocks(w.to(torch.float8_e4m3fn), scale)
    expected = torch.zeros(2, 64)
    expected[0, 0] = 0.1875
    expected[0, 31] = -56.0
    expected[0, 32] = 2.0
    expected[1, 5] = 0.000244140625
    expected[1, 40] = 960.0
    expected[1, 63] = -13.0
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    # Same with the block given explicitly, and to bf16 (exact: fp8 * 2^k fits bf16).
    out_bf16 = dequantize_fp8_blocks(w.to(torch.float8_e4m3fn), scale, block=(32, 32), out_dtype=torch.bfloat16)
    assert out_bf16.dtype == torch.bfloat16 and torch.equal(out_bf16.float(), expected)


def _reference_dequant_fp8(w8: torch.Tensor, s: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    w = w8.double()
    sf = s.double()
    out = torch.empty_like(w)
    for i in range(sf.shape[0]):
        for j in range(sf.shape[1]):
            out[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] * sf[i, j]
    return out


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((96, 64), (32, 32)), ((100, 70), (32, 32))])
def test_dequantize_fp8_inferred_block_matches_reference(shape, block):
    w8 = (torch.randn(shape) * 50).to(torch.float8_e4m3fn)
    srows, scols = math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])
    s = e8m0(torch.randint(-10, 10, (srows, scols)))
    ref = _reference_dequant_fp8(w8, s, *block)
    assert torch.equal(dequantize_fp8_blocks(w8, s).double(), ref)  # inferred
    assert torch.equal(dequantize_fp8_blocks(w8, s, block=block).double(), ref)


def test_dequantize_fp8_stacked_leading_dims():
    w8 = torch.randn(3, 64, 96).to(torch.float8_e4m3fn)
    s = e8m0(torch.randint(-5, 5, (3, 2, 3)))
    out = dequantize_fp8_blocks(w8, s, block=(32, 32))
    for e in range(3):
        assert torch.equal(out[e].double(), _reference_dequant_fp8(w8[e], s[e], 32, 32))


def test_quantize_fp8_roundtrip_exact_on_representable_values():
    # Each 32x32 block: fp8-representable values with one element at 448, times 2^k.
    # Then amax/448 = 2^k exactly, the chosen scale is 2^k and the round trip is lossless.
    q = (torch.randn(64, 96) * 40).to(torch.float8_e4m3fn).float()
    q[::32, ::32] = 448.0
    exps = torch.randint(-12, 8, (2, 3))
    w = q * (2.0 ** exps.float()).repeat_interleave(32, 0).repeat_interleave(32, 1)
    w8, s = quantize_fp8_blocks(w)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == (64, 96)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    assert torch.equal(s.view(torch.uint8).int() - 127, exps.int())
    assert torch.equal(w8.float(), q)
    assert torch.equal(dequantize_fp8_blocks(w8, s), w)


def test_quantize_fp8_partial_blocks_error_bound():
    w = torch.randn(40, 70) * torch.logspace(-3, 3, 70)
    w8, s = quantize_fp8_blocks(w, block=(32, 32))
    assert s.shape == (2, 3)
    deq = dequantize_fp8_blocks(w8, s)  # inference picks 32 for 40/2 and 70/3
    assert torch.equal(deq, dequantize_fp8_blocks(w8, s, block=(32, 32)))
    sf = s.float().repeat_interleave(32, 0)[:40].repeat_interleave(32, 1)[:, :70]
    assert torch.all((deq - w).abs() <= torch.maximum(w.abs() * 2.0**-4, sf * 2.0**-10))


def test_quantize_fp8_scale_rule():
    w = torch.zeros(32, 64)
    w[0, 0] = 449.0  # amax/448 just above 1 -> scale 2 (ceil)
    w[0, 32] = 448.0  # exactly 1 -> scale 1
    _, s = quantize_fp8_blocks(w)
    assert s.float().tolist() == [[2.0, 1.0]]
    _, s0 = quantize_fp8_blocks(torch.zeros(32, 32))  # amax floored at 1e-4
    assert s0.float().item() == 2.0 ** math.ceil(math.log2(1e-4 / 448))


def test_fp8_block_qdq_consistency():
    w = torch.randn(8, 128) * 3
    w8, s = quantize_fp8_blocks(w, block=(1, 32))
    assert torch.equal(dequantize_fp8_blocks(w8, s, block=(1, 32)), fp8_qdq(w, 32))


def test_dequantize_fp8_errors():
    w8 = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected dtype torch.float8_e4m3fn, got torch.float32"):
        dequantize_fp8_blocks(torch.zeros(64, 64), e8m0([[0, 0], [0, 0]]))
    with pytest.raises(ValueError, match=r"expected dtype torch.float8_e8m0fnu, got torch.float32"):
        dequantize_fp8_blocks(w8, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"expected shape \(1, 1\) .*block \(128, 128\), got \(2, 2\)"):
        dequantize_fp8_blocks(w8, e8m0([[0, 0], [0, 0]]), block=(128, 128))
    with pytest.raises(ValueError, match=r"expected shape \(2, 2\) .*got \(2, 3\)"):
        dequantize_fp8_blocks(w8, e8m0([[0, 0, 0], [0, 0, 0]]), block=(32, 32))
    with pytest.raises(ValueError, match=r"ambiguous row block size.*pass block="):
        dequantize_fp8_blocks(torch.zeros(90, 32, dtype=torch.float8_e4m3fn), e8m0([[0]] * 4))
    with pytest.raises(ValueError, match=r"scale cols"):
        dequantize_fp8_blocks(w8, e8m0([[0] * 65] * 2))
    with pytest.raises(ValueError, match=r"NaN code 0xFF"):
        dequantize_fp8_blocks(w8, torch.full((2, 2), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match=r"\[\.\.\., out, in\]"):
        dequantize_fp8_blocks(torch.zeros(64, dtype=torch.float8_e4m3fn), e8m0([0]))
    with pytest.raises(ValueError, match=r"float32/bfloat16"):
        quantize_fp8_blocks(w8)
    with pytest.raises(ValueError, match=r"positive int"):
        quantize_fp8_blocks(torch.zeros(4, 4), block=(0, 32))


# ----------------------------------------------------------------------------- packed fp4


def test_unpack_fp4_byte_layout():
    # 0x2F: low nibble 0xF = -6 (element 0), high nibble 0x2 = 1.0 (element 1)
    # 0x9A (int8 -102): low 0xA = -1.0, high 0x9 = -0.5
    # 0x70: low 0x0 = 0, high 0x7 = 6
    packed = torch.tensor([[0x2F, 0x9A - 256, 0x70]], dtype=torch.int8)
    out = unpack_fp4(packed)
    assert out.dtype == torch.float32 and out.shape == (1, 6)
    assert out.tolist() == [[-6.0, 1.0, -1.0, -0.5, 0.0, 6.0]]
    assert torch.equal(unpack_fp4(packed.view(torch.uint8)), out)
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert torch.equal(unpack_fp4(packed.view(torch.float4_e2m1fn_x2)), out)


def test_pack_fp4_byte_layout_and_roundtrip():
    assert pack_fp4(torch.tensor([0xF, 0x2, 0xA, 0x9], dtype=torch.uint8)).tolist() == [0x2F, 0x9A - 256]
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.shape == (3, 5, 32)
    vals = unpack_fp4(packed)
    assert torch.equal(vals, E2M1_VALUES[codes.long()])
    assert torch.equal(torch.signbit(vals), codes >= 8)  # -0 survives as code 8
    assert torch.equal(pack_fp4(codes.long()), packed)  # any integer dtype accepted


def test_dequantize_fp4_packed_known_scales():
    codes = torch.tensor([list(range(16)) * 2, list(range(15, -1, -1)) * 2], dtype=torch.uint8)
    scale = e8m0([[-1], [3]])  # row 0: x 0.5, row 1: x 8
    out = dequantize_fp4_packed(pack_fp4(codes), scale)
    row0 = [0, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 0, -0.25, -0.5, -0.75, -1, -1.5, -2, -3] * 2
    row1 = [-48, -32, -24, -16, -12, -8, -4, 0, 48, 32, 24, 16, 12, 8, 4, 0] * 2
    assert out.tolist() == [row0, row1]
    # Two scales per row: the scale index advances every 32 logical (16 packed) elements.
    codes64 = torch.full((1, 64), 2, dtype=torch.uint8)  # all 1.0
    out2 = dequantize_fp4_packed(pack_fp4(codes64), e8m0([[0, 2]]), out_dtype=torch.bfloat16)
    assert out2.dtype == torch.bfloat16
    assert out2.float().tolist() == [[1.0] * 32 + [4.0] * 32]


def test_quantize_fp4_packed_roundtrip_exact_on_representable_values():
    codes = torch.randint(0, 16, (4, 6, 128), dtype=torch.uint8)
    codes[..., ::32] = 7  # one 6.0 per block -> amax/6 = 2^k exactly
    exps = torch.randint(-20, 20, (4, 6, 4))
    w = E2M1_VALUES[codes.long()] * (2.0 ** exps.float()).repeat_interleave(32, -1)
    packed, scale = quantize_fp4_packed(w)
    assert packed.dtype == torch.int8 and packed.shape == (4, 6, 64)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (4, 6, 4)
    assert torch.equal(scale.view(torch.uint8).int() - 127, exps.int())
    assert torch.equal(packed, pack_fp4(codes))  # bit-exact, including -0 codes
    assert torch.equal(dequantize_fp4_packed(packed, scale), w)


def test_quantize_fp4_packed_matches_qdq():
    w = torch.randn(5, 3, 96) * torch.logspace(-4, 4, 96)
    packed, scale = quantize_fp4_packed(w)
    assert torch.equal(dequantize_fp4_packed(packed, scale), fp4_qdq_ue8m0(w))
    # Partial last block (n=40, block 32): padded for amax, scale shape ceil(40/32)=2.
    w40 = torch.randn(2, 40)
    p40, s40 = quantize_fp4_packed(w40)
    assert p40.shape == (2, 20) and s40.shape == (2, 2)
    assert torch.equal(dequantize_fp4_packed(p40, s40)[:, :32], fp4_qdq_ue8m0(w40[:, :32]))


def test_fp4_packed_errors():
    with pytest.raises(ValueError, match=r"expected dtype torch.int8 or torch.uint8.*got torch.float32"):
        unpack_fp4(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"expected values in \[0, 15\], got range \[0, 16\]"):
        pack_fp4(torch.tensor([0, 16]))
    with pytest.raises(ValueError, match=r"expected an integer dtype"):
        pack_fp4(torch.zeros(4))
    with pytest.raises(ValueError, match=r"last dimension 3 .*not divisible by the block size 2"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
    packed = torch.zeros(2, 32, dtype=torch.int8)  # 64 logical values per row
    with pytest.raises(ValueError, match=r"expected shape \(2, 2\) .*block 32\), got \(2, 1\)"):
        dequantize_fp4_packed(packed, e8m0([[0], [0]]))
    with pytest.raises(ValueError, match=r"expected dtype torch.float8_e8m0fnu, got torch.float32"):
        dequantize_fp4_packed(packed, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"last dimension 7 .*divisible by the block size 2"):
        quantize_fp4_packed(torch.zeros(2, 7))
    with pytest.raises(ValueError, match=r"float32/bfloat16"):
        quantize_fp4_packed(torch.zeros(2, 32, dtype=torch.int32))


# ----------------------------------------------------------------------------- runtime QDQ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_qdq_error_bound(dtype):
    x = (torch.randn(3, 5, 256) * torch.logspace(-3, 3, 256)).to(dtype)
    y = fp8_qdq(x)
    assert y.dtype == dtype and y.shape == x.shape
    xd, yd = x.double(), y.double()
    s = block_pow2_scale(x, 32, 448.0, 1e-4).repeat_interleave(32, -1)
    # Per-block scale keeps amax in (224, 448]; e4m3 RNE error: 2^-4 relative, 2^-10*scale absolute
    # in the subnormal range.
    amax = xd.reshape(3, 5, 8, 32).abs().amax(-1)
    sb = s[..., ::32]
    assert torch.all(amax / sb <= 448) and torch.all((amax / sb > 224) | (amax < 1e-4))
    assert torch.all((yd - xd).abs() <= torch.maximum(xd.abs() * 2.0**-4, s * 2.0**-10))
    q = (yd / s).float()
    assert torch.equal(q.to(torch.float8_e4m3fn).float(), q)  # outputs sit on the e4m3 grid


def test_fp8_qdq_hand_computed():
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([900.0, 1.3, -100.0, 0.001, 3.0])
    # amax 900 -> 900/448 = 2.009 -> scale 4. x/4 = [225, 0.325, -25, 0.00025, 0.75]
    # e4m3 RNE: 225 -> 224, 0.325 -> 0.3125, -25 -> -24 (tie between 24 and 26 -> even mantissa),
    # 0.00025 -> 0 (below half the smallest subnormal 2^-10), 0.75 -> 0.75.
    y = fp8_qdq(x)
    assert y[0, :5].tolist() == [896.0, 1.25, -96.0, 0.0, 3.0]
    assert torch.all(y[0, 5:] == 0)


def test_fp8_qdq_bf16_matches_float32():
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 7
    assert torch.equal(fp8_qdq(x), fp8_qdq(x.float()).to(torch.bfloat16))


def test_fp4_qdq_ue8m0_ties_and_values():
    x = torch.zeros(2, 32)
    x[0, :15] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                              -0.25, -0.75, -2.5, 0.26, 2.6, 4.9, 5.1])
    # amax 6 -> scale 1; ties go to the even code.
    expected0 = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -1.0, -2.0, 0.5, 3.0, 4.0, 6.0]
    x[1, :4] = torch.tensor([7.0, -3.0, 1.0, 0.2])
    # amax 7 -> 7/6 = 1.17 -> scale 2; x/2 = [3.5, -1.5, 0.5, 0.1] -> [4, -1.5, 0.5, 0]
    expected1 = [8.0, -3.0, 1.0, 0.0]
    y = fp4_qdq_ue8m0(x)
    assert y[0, :15].tolist() == expected0
    assert y[1, :4].tolist() == expected1
    assert torch.all(y[0, 15:] == 0) and torch.all(y[1, 4:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_qdq_ue8m0_is_nearest_on_grid(dtype):
    x = (torch.randn(7, 3, 128) * torch.logspace(-5, 5, 128)).to(dtype)
    y = fp4_qdq_ue8m0(x)
    assert y.dtype == dtype and y.shape == x.shape
    s = block_pow2_scale(x, 32, 6.0, 6 * 2.0**-126).repeat_interleave(32, -1)
    v, w = x.double() / s, y.double() / s
    assert torch.all(v.abs() <= 6)
    assert torch.all(torch.isin(w.abs(), POS_E2M1))
    assert torch.all((w - v).abs() <= nearest_e2m1_distance(v) + 1e-12)
    assert torch.all((torch.sign(w) == torch.sign(v)) | (w == 0))


def test_fp4_qdq_e4m3_hand_computed():
    x = torch.zeros(2, 16)
    x[0, :4] = torch.tensor([6.3, 1.2, -0.3, 2.6])
    # amax/6 = 1.05 -> e4m3 1.0 (grid 1.0, 1.125); x/1 -> [6 (saturated), 1, -0.5, 3]
    x[1, :3] = torch.tensor([12.0, -5.0, 0.9])
    # amax/6 = 2.0 exactly; x/2 = [6, -2.5, 0.45] -> [6, -2 (tie to even), 0.5] -> x2
    y = fp4_qdq_e4m3(x)
    assert y[0, :4].tolist() == [6.0, 1.0, -0.5, 3.0]
    assert y[1, :3].tolist() == [12.0, -4.0, 1.0]
    assert torch.all(y[0, 4:] == 0) and torch.all(y[1, 3:] == 0)


def test_fp4_qdq_e4m3_is_nearest_on_grid():
    x = torch.randn(6, 4, 64) * torch.logspace(-2, 2, 64)
    y = fp4_qdq_e4m3(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    amax = x.reshape(6, 4, 4, 16).abs().amax(-1).clamp_min(6 * 2.0**-9)
    s = (amax / 6).to(torch.float8_e4m3fn).float().repeat_interleave(16, -1).double()
    v, w = x.double() / s, y.double() / s
    assert torch.all(torch.isin(w.abs(), POS_E2M1))
    assert torch.all((w - v).abs() <= nearest_e2m1_distance(v) + 1e-6)


@pytest.mark.parametrize("fn,block", [(fp8_qdq, 32), (fp4_qdq_ue8m0, 32), (fp4_qdq_e4m3, 16)])
def test_qdq_zero_and_tiny_blocks_are_finite(fn, block):
    x = torch.zeros(2, block * 2)
    x[1, :block] = 1e-30
    y = fn(x)
    assert torch.all(torch.isfinite(y))
    assert torch.all(y[0] == 0)
    assert torch.all(y[1].abs() <= 2e-30)  # fp4 may round 1e-30 up by at most 6/5


@pytest.mark.parametrize("fn,block", [(fp8_qdq, 32), (fp4_qdq_ue8m0, 32), (fp4_qdq_e4m3, 16)])
def test_qdq_errors(fn, block):
    with pytest.raises(ValueError, match=rf"last dimension {block + 1} .*not divisible by the block size {block}"):
        fn(torch.randn(4, block + 1))
    with pytest.raises(ValueError, match=r"expected a float32/bfloat16/float16/float64 tensor, got dtype torch.int64"):
        fn(torch.zeros(4, block, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"got dtype torch.float8_e4m3fn"):
        fn(torch.zeros(4, block).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"positive int"):
        fn(torch.zeros(4, block), 0)
    with pytest.raises(ValueError, match=r"0-d"):
        fn(torch.tensor(1.0))
    # A subclass of ValueError, so callers may catch either.
    with pytest.raises(QuantFormatError):
        fn(torch.randn(block + 1))


@pytest.mark.parametrize("fn,block", [(fp8_qdq, 32), (fp4_qdq_ue8m0, 32), (fp4_qdq_e4m3, 16)])
def test_qdq_leading_shapes(fn, block):
    x = torch.randn(2, 3, 4, block * 3)
    y = fn(x)
    assert y.shape == x.shape
    assert torch.equal(y.reshape(-1, block * 3), fn(x.reshape(-1, block * 3)))
    assert torch.equal(fn(x[0, 0, 0]), y[0, 0, 0])  # 1-D works too
