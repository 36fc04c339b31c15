"""rg.quant's formats pinned on crafted inputs (each rule of [Note: the formats, pinned] once),
plus bounded properties: error bounds, 3-D tensors, input dtypes, non-finite input."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ragged as rg
from ragged.quant import _codec
from tests._cuda_division import cuda_division

E4M3 = torch.float8_e4m3fn
FORMATS = [rg.quant.fp8(block=(2, 4)), rg.quant.int8(block=(2, 4)), rg.quant.mxfp8(block=4)]


def _q(x, fmt):
    return rg.quant.quantize(torch.tensor(x, dtype=torch.float32), fmt)


# ---- scales ------------------------------------------------------------------------------------
def test_fp8_scale_is_amax_over_448_and_one_for_a_zero_block():
    x = torch.tensor([[0.0, 0.0, 3.0, -7.0]])
    codes, scales = rg.quant.quantize(x, rg.quant.fp8(block=(1, 2)))
    assert scales.tolist() == [[1.0, torch.tensor(7.0) .div(448).item()]]
    assert codes[0, :2].float().tolist() == [0.0, 0.0]
    assert codes[0, 3].float().item() == -448.0          # the amax element is the largest code


def test_int8_scale_is_amax_over_127_and_one_for_a_zero_block():
    codes, scales = _q([[0.0, 0.0, 2.0, -5.0]], rg.quant.int8(block=(1, 2)))
    assert scales.tolist() == [[1.0, torch.tensor(5.0).div(127).item()]]
    assert codes.tolist() == [[0, 0, 51, -127]]          # 2 / (5 / 127) = 50.8 -> 51


def test_a_scale_that_underflows_is_one_and_its_codes_zero():
    tiny = 2.0 ** -149                                   # amax / 448 and amax / 127 are 0 in float32
    for fmt in (rg.quant.fp8(block=(1, 2)), rg.quant.int8(block=(1, 2))):
        codes, scales = _q([[tiny, -tiny]], fmt)
        assert scales.tolist() == [[1.0]] and codes.float().tolist() == [[0.0, 0.0]], fmt


def test_fp8_subnormal_amax_keeps_a_subnormal_scale():
    amax = 2.0 ** -130                                   # a float32 subnormal; amax / 448 is one too, not 0
    codes, scales = _q([[amax, amax / 2]], rg.quant.fp8(block=(1, 2)))
    assert scales.item() == torch.tensor(amax).div(448).item() > 0
    assert codes.float().tolist() == [[448.0, 224.0]]


@pytest.mark.parametrize("fmt, amax", [
    (rg.quant.fp8(block=(1, 2)), [3.0, 11.0, 0.3, 9.0 * 2.0**-20, 13.0 * 2.0**40, 65504.0]),
    (rg.quant.int8(block=(1, 2)), [9.0, 13.0, 143.0, 175.0 * 2.0**-100, 9.0 * 2.0**-20, 13.0 * 2.0**40]),
], ids=["fp8", "int8"])
def test_scales_are_the_true_quotient_where_a_gpu_would_multiply_by_the_reciprocal(fmt, amax):
    """amax values whose ``amax / q`` and ``amax * fp32(1 / q)`` differ in float32: the scales are
    the correctly rounded quotient also under CUDA's division by a host scalar (emulated: see
    [Note: a division every device rounds alike] in ragged/_divide.py)."""
    amax, q = torch.tensor(amax), fmt.qmax
    product = amax * (torch.ones(()) / q)
    assert torch.all(amax / q != product)  # crafted: every one differs
    x = torch.stack([amax, -amax / 3], dim=1)
    with cuda_division() as seen:
        _, scales = rg.quant.quantize(x, fmt)
    assert torch.equal(scales.reshape(-1), (amax.double() / q).float())  # float64 then rounded: the true quotient
    assert seen.count == 0  # no division by a host scalar left in quantize


def test_mxfp8_scale_is_a_floor_power_of_two_clamped_to_e8m0():
    fmt = rg.quant.mxfp8(block=2)
    cases = {  # amax -> exponent of the scale
        4.0: 2 - 8,                                     # exactly a power of two
        4.0 * (1 - 2.0 ** -24): 1 - 8,                   # just below it
        3.0: 1 - 8, 0.75: -1 - 8, 2.0 ** 127 * 1.5: 127 - 8,
        2.0 ** -126: -127,                               # floor(log2) - 8 = -134, clamped to e8m0's -127
        2.0 ** -140: -127,                               # a subnormal amax: frexp gets its exponent exactly
    }
    for amax, e in cases.items():
        _, scales = _q([amax, -amax / 3], fmt)
        assert scales.tolist() == [2.0 ** e], amax
    codes, scales = _q([0.0, 0.0], fmt)
    assert scales.tolist() == [2.0 ** -127] and codes.float().tolist() == [0.0, 0.0]


def test_mxfp8_clamps_codes_above_448():
    # amax just below a power of two: x / scale is just below 512, beyond e4m3's 448
    amax = 4.0 * (1 - 2.0 ** -24)
    codes, scales = _q([amax, -amax, 3.5, 1.0], rg.quant.mxfp8(block=4))
    assert scales.item() == 2.0 ** -7
    assert codes.float().tolist() == [448.0, -448.0, 448.0, 128.0]


# ---- codes -------------------------------------------------------------------------------------
def test_fp8_codes_round_half_to_even_normal_and_subnormal():
    # amax 448 -> scale 1 exactly, so the codes are the values' own e4m3 rounding
    x = [448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, -(2.0 ** -10), 0.0]
    codes, scales = _q([x], rg.quant.fp8(block=(1, 8)))
    assert scales.item() == 1.0
    got = codes.float().tolist()[0]
    assert got == [448.0, 1.0, 1.25, -1.0, 0.0, 2.0 ** -8, -0.0, 0.0]
    assert math.copysign(1.0, got[6]) == -1.0           # the sign of a value that rounds to zero is kept


def test_int8_codes_round_half_to_even():
    codes, scales = _q([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]], rg.quant.int8(block=(1, 8)))
    assert scales.item() == 1.0
    assert codes.tolist() == [[127, 0, 2, 2, 0, -2, -2, 126]]


def test_fp8_codes_never_exceed_448():
    # amax / (amax / 448) rounds above 448 for some amax: the clamp keeps the code at 448
    g = torch.Generator().manual_seed(0)
    x = torch.rand(512, 8, generator=g) * 1000 + 1e-3
    codes, _ = rg.quant.quantize(x, rg.quant.fp8(block=(1, 8)))
    assert codes.float().abs().amax(dim=1).eq(448.0).all()


def test_dequantize_is_a_float32_product_cast_last():
    fmt = rg.quant.fp8(block=(1, 2))
    codes, scales = _q([[1.0, 0.1]], fmt)
    want = codes.float() * scales.repeat_interleave(2, dim=1)
    assert torch.equal(rg.quant.dequantize(codes, scales, fmt), want)
    assert torch.equal(rg.quant.dequantize(codes, scales, fmt, dtype=torch.float64), want.double())
    assert torch.equal(rg.quant.dequantize(codes, scales, fmt, dtype=torch.bfloat16), want.bfloat16())


# ---- shapes ------------------------------------------------------------------------------------
def test_3d_tensors_are_quantized_matrix_by_matrix():
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))
    for fmt in FORMATS:
        codes, scales = rg.quant.quantize(x, fmt)
        per = [rg.quant.quantize(x[e], fmt) for e in range(3)]
        assert torch.equal(codes.view(torch.uint8), torch.stack([c for c, _ in per]).view(torch.uint8)), fmt
        assert torch.equal(scales, torch.stack([s for _, s in per])), fmt
        assert torch.equal(rg.quant.dequantize(codes, scales, fmt),
                           torch.stack([rg.quant.dequantize(c, s, fmt) for c, s in per])), fmt


def test_vectors_are_one_row():
    x = torch.arange(8.0)
    codes, scales = rg.quant.quantize(x, rg.quant.mxfp8(block=4))
    assert scales.shape == (2,) and codes.shape == (8,)
    c2, s2 = rg.quant.quantize(x.view(1, 8), rg.quant.mxfp8(block=4))
    assert torch.equal(codes.view(torch.uint8), c2.view(-1).view(torch.uint8)) and torch.equal(scales, s2.view(-1))


@pytest.mark.parametrize("shape, fmt, why", [
    ((), rg.quant.fp8(block=(1, 1)), "a 0-d or empty tensor has no blocks"),
    ((0, 4), rg.quant.int8(block=(1, 4)), "a 0-d or empty tensor has no blocks"),
    ((256,), rg.quant.fp8(block=(128, 128)), "a vector is one row"),
    ((256, 100), rg.quant.fp8(block=(128, 128)), "must be multiples of the block (128, 128)"),
    ((64, 64), rg.quant.fp8(block=(128, 128)), "must be multiples of the block (128, 128)"),   # block larger than the tensor
    ((2, 6, 64), rg.quant.int8(block=(4, 32)), "(6, 64) must be multiples of the block (4, 32)"),
    ((4, 48), rg.quant.mxfp8(), "must be multiples of the block (1, 32)"),
])
def test_shapes_the_block_does_not_tile_are_refused(shape, fmt, why):
    with pytest.raises(rg.LayoutError, match=re.escape(why)) as err:
        rg.quant.quantize(torch.zeros(shape), fmt)
    assert f"has shape {shape}" in str(err.value) and repr(fmt) in str(err.value) and "Fix:" in str(err.value)


def test_bad_formats_and_inputs_are_refused():
    with pytest.raises(rg.RaggedValueError, match="block rows must be a positive int"):
        rg.quant.fp8(block=(0, 4))
    with pytest.raises(rg.RaggedTypeError, match=re.escape("block=(128, 128)")):
        rg.quant.int8(block=128)
    with pytest.raises(rg.RaggedValueError, match="1 x k"):
        rg.quant.Format("mxfp8", (2, 32))
    with pytest.raises(rg.RaggedTypeError, match="floating-point tensor"):
        rg.quant.quantize(torch.zeros(4, 4, dtype=torch.int32), rg.quant.int8(block=(1, 4)))
    with pytest.raises(rg.RaggedTypeError, match="must be a rg.quant format"):
        rg.quant.quantize(torch.zeros(4, 4), "fp8")
    codes, scales = rg.quant.quantize(torch.ones(4, 4), rg.quant.fp8(block=(2, 2)))
    with pytest.raises(rg.LayoutError, match="pass the scales quantize returned"):
        rg.quant.dequantize(codes, scales.view(-1), rg.quant.fp8(block=(2, 2)))


# ---- input dtypes, non-finite input ------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_float64_and_bf16_inputs_are_cast_to_float32_first(fmt):
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for source in (x, x.bfloat16()):
        c1, s1 = rg.quant.quantize(source, fmt)
        c2, s2 = rg.quant.quantize(source.float(), fmt)
        assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8)) and torch.equal(s1, s2)


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_non_finite_blocks_stay_non_finite(fmt):
    x = torch.ones(2, 8)
    x[0, 1], x[1, 6] = float("nan"), float("inf")
    back = rg.quant.dequantize(*rg.quant.quantize(x, fmt), fmt)
    bad = ~torch.isfinite(back)
    assert bad[0, 1] and bad[1, 6]
    # blocks without a non-finite element are untouched by their neighbours
    r, c = fmt.block
    clean = torch.ones(2, 8, dtype=torch.bool)
    for i, j in ((0, 1), (1, 6)):
        clean[i // r * r: i // r * r + r, j // c * c: j // c * c + c] = False
    assert torch.equal(back[clean], x[clean])


# ---- properties ----------------------------------------------------------------------------------
@settings(max_examples=40)
@given(kind=st.sampled_from(["fp8", "int8", "mxfp8"]), bands=st.integers(1, 3), cols=st.integers(1, 3),
       log_scale=st.integers(-30, 30), seed=st.integers(0, 2**16))
def test_error_bounds_and_runs_of_whole_blocks(kind, bands, cols, log_scale, seed):
    fmt = {"fp8": rg.quant.fp8(block=(2, 4)), "int8": rg.quant.int8(block=(2, 4)), "mxfp8": rg.quant.mxfp8(block=4)}[kind]
    r, c = fmt.block
    x = torch.randn(bands * 2, cols * c, generator=torch.Generator().manual_seed(seed)) * 2.0 ** log_scale
    codes, scales = rg.quant.quantize(x, fmt)
    back = rg.quant.dequantize(codes, scales, fmt)
    step = scales.repeat_interleave(r, dim=-2).repeat_interleave(c, dim=-1)
    err = (back - x).abs()
    if kind == "int8":       # half a step, plus the float32 rounding of the product
        assert (err <= step * 0.5 * (1 + 2.0 ** -20) + x.abs() * 2.0 ** -23).all()
    else:                    # e4m3: 3 mantissa bits (2**-4 relative), subnormal step 2**-9; mxfp8 also clamps
        bound = torch.maximum(x.abs() * 2.0 ** -4, step * 2.0 ** -10) * (1 + 2.0 ** -20)
        if kind == "mxfp8":
            bound = bound + (x.abs() - 448 * step).clamp(min=0)
        assert (err <= bound).all()
    # a run of whole blocks, quantized on its own, gives the whole tensor's codes and scales
    rows_per_run = r if r > 1 else 1
    run = rows_per_run * x.shape[1]
    flat = x.reshape(-1)
    for start in range(0, flat.numel(), run):
        rc, rs = _codec.quantize_run(flat[start:start + run], x.shape[1], fmt)
        assert torch.equal(rc.view(torch.uint8), codes.reshape(-1)[start:start + run].view(torch.uint8))
        nb = run // fmt.block_numel
        assert torch.equal(rs, scales.reshape(-1)[start // fmt.block_numel: start // fmt.block_numel + nb])
