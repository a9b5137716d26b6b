"""int8 weights times int8 activations (``isa="avx2_a8"`` of ``nmsparse::cpu24_linear_q8`` and
``nmsparse::cpu24_dense_q8``) against the definition: the activations quantized in blocks of 32 positions, the
integer products summed exactly, a block's scale times its row's (``reference.int8_activation_linear``)."""

import pytest
import torch
import torch.nn.functional as F

import reference
from nmcompile import pack
from nmcompile.kernels import cpu24
from nmcompile.kernels.cpu24.quantize import dense_rows, quantize_dense, quantize_layout

pytestmark = pytest.mark.skipif("avx2" not in cpu24.isas(), reason="the int8-activation route needs AVX2")

A8 = cpu24.A8_ISA
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# K: 16, 32, 48 (no whole step of 64), 80, 224, 240, 1040 (1, 2, 3, 1 words after the steps), 4096
SHAPES = [(1, 16), (7, 32), (9, 48), (9, 80), (8, 224), (17, 240), (33, 1040), (24, 4096)]


def sparse_weight(out_f, in_f, seed=0):
    """(codes, bits, scales, codes as a dense [out_f, in_f] int tensor) of a random 2:4 int8 weight."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g)
    w = w * reference.topn_mask(w, 2, 4, -1)
    p = pack(w)
    values, bits = cpu24.cpu_layout(p.values, p.meta)
    codes, scales = quantize_layout(values, out_f)
    return codes, bits, scales, cpu24.unpack(codes, bits, out_f)


def dense_weight(out_f, in_f, seed=0):
    g = torch.Generator().manual_seed(seed)
    values, scales = quantize_dense(torch.randn(out_f, in_f, generator=g))
    return values, scales, dense_rows(values, out_f)


def check(y, x, codes, scales, bias):
    """Against the definition: fp32 sums of exact block products (a bound of K/8 fp32 roundings of the
    terms' magnitudes), then the output rounded to the input's dtype."""
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], codes.shape[0])
    expected = reference.int8_activation_linear(x, codes, scales, bias)
    magnitude = reference.int8_activation_linear(x.abs(), codes.abs(), scales, None if bias is None else bias.abs())
    eps = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}[x.dtype]  # an ulp, relative
    bound = magnitude * (x.shape[-1] / 8 * 2**-24) + expected.abs() * eps + 1e-30
    assert bool(((y.double() - expected).abs() <= bound).all()), (y.double() - expected).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_f,in_f", SHAPES)
def test_2_4_int8_weights_match_the_definition(dtype, out_f, in_f):
    codes, bits, scales, dense = sparse_weight(out_f, in_f, seed=in_f)
    bias = torch.randn(out_f).to(dtype)
    for tokens in (0, 1, 2, 3, 5, 17):
        x = torch.randn(tokens, in_f).to(dtype)
        check(torch.ops.nmsparse.cpu24_linear_q8(x, codes, bits, scales, bias, out_f, -1, A8), x, dense, scales, bias)
    x = torch.randn(in_f, 3).t().to(dtype)  # strided
    check(torch.ops.nmsparse.cpu24_linear_q8(x, codes, bits, scales, None, out_f, -1, A8), x, dense, scales, None)
    x3 = torch.randn(2, 3, in_f).to(dtype)
    check(torch.ops.nmsparse.cpu24_linear_q8(x3, codes, bits, scales, None, out_f, -1, A8), x3, dense, scales, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_f,in_f", SHAPES)
def test_dense_int8_rows_match_the_definition(dtype, out_f, in_f):
    values, scales, codes = dense_weight(out_f, in_f, seed=in_f)
    bias = torch.randn(out_f).to(dtype)
    for tokens in (0, 1, 2, 5, 9):
        x = torch.randn(tokens, in_f).to(dtype)
        check(torch.ops.nmsparse.cpu24_dense_q8(x, values, scales, bias, out_f, -1, A8), x, codes, scales, bias)


def test_the_error_is_the_activations_rounding_against_the_float_route():
    codes, bits, scales, dense = sparse_weight(64, 4096)
    x = torch.randn(4, 4096)
    exact = F.linear(x.double(), dense.double() * scales.double()[:, None])
    a8 = torch.ops.nmsparse.cpu24_linear_q8(x, codes, bits, scales, None, 64, -1, A8).double()
    flt = torch.ops.nmsparse.cpu24_linear_q8(x, codes, bits, scales, None, 64, -1, "avx2").double()
    assert float((flt - exact).norm() / exact.norm()) < 1e-6
    error = float((a8 - exact).norm() / exact.norm())
    assert 1e-4 < error < 1e-2  # the activations rounded to 8 bits (not exact, not another product)


def test_outliers_stay_in_their_block_and_zero_blocks_give_the_bias():
    codes, bits, scales, dense = sparse_weight(16, 128)
    x = torch.randn(2, 128)
    x[0, 3] = 1e4  # the first block's scale only: the other three keep their resolution
    x[1, 32:64] = 0
    bias = torch.randn(16)
    y = torch.ops.nmsparse.cpu24_linear_q8(x, codes, bits, scales, bias, 16, -1, A8)
    check(y, x, dense, scales, bias)
    zero = torch.zeros(1, 128)
    assert torch.equal(torch.ops.nmsparse.cpu24_linear_q8(zero, codes, bits, scales, bias, 16, -1, A8), bias[None])


def test_nan_and_inf_make_their_tokens_outputs_nan():
    codes, bits, scales, _ = sparse_weight(16, 96)
    values, dscales, _ = dense_weight(16, 96)
    x = torch.randn(3, 96)
    x[0, 5], x[1, 70] = float("nan"), float("inf")
    for y in (torch.ops.nmsparse.cpu24_linear_q8(x, codes, bits, scales, None, 16, -1, A8),
              torch.ops.nmsparse.cpu24_dense_q8(x, values, dscales, None, 16, -1, A8)):
        assert bool(torch.isnan(y[:2]).all()) and bool(torch.isfinite(y[2]).all())


def test_calls_past_max_tokens_take_the_float_dense_gemm():
    codes, bits, scales, _ = sparse_weight(24, 64)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    op = torch.ops.nmsparse.cpu24_linear_q8
    assert torch.equal(op(x, codes, bits, scales, None, 24, 4, A8), op(x, codes, bits, scales, None, 24, 4, "avx2"))
    values, dscales, _ = dense_weight(24, 64)
    dop = torch.ops.nmsparse.cpu24_dense_q8
    assert torch.equal(dop(x, values, dscales, None, 24, 2, A8), dop(x, values, dscales, None, 24, 2, "avx2"))


def test_float_weights_and_unknown_activations_are_refused_by_name():
    w = torch.randn(16, 64)
    w = w * reference.topn_mask(w, 2, 4, -1)
    p = pack(w)
    values, bits = cpu24.cpu_layout(p.values, p.meta)
    with pytest.raises(RuntimeError, match="quantizes the activations for int8 and 4-bit weights"):
        torch.ops.nmsparse.cpu24_linear(torch.randn(1, 64), values, bits, None, None, 16, -1, A8)
    with pytest.raises(ValueError, match="'float' .* or 'int8'"):
        cpu24.int8_isa("fp8")
    assert cpu24.int8_isa("int8") == A8 and cpu24.int8_isa("float") == cpu24.best_isa(torch.int8)
