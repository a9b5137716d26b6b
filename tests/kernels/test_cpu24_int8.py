"""2:4 with int8 values: the kernel (``nmsparse::cpu24_linear_q8``) on every ISA path against a float64
product of the dequantized weight, and the row quantizer against its definition (round to nearest on a
symmetric grid of 127 levels a side, one fp32 scale per row)."""

import pytest
import torch
import torch.nn.functional as F

import reference
from nmcompile import pack
from nmcompile.kernels import cpu24
from nmcompile.kernels.cpu24.quantize import LEVELS, quantize_layout, row_scales

pytestmark = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")

ISAS = ("avx2", "avx512", "emulated512")
# (rtol, atol per sqrt(K)) against the float64 product of the same rounded operands: fp32 sums, the output
# rounded to the input's dtype
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2**-7, 2e-3), torch.float16: (2**-10, 2e-3)}


def _skip_unless_runs(isa):
    if isa != "emulated512" and isa not in cpu24.isas():
        pytest.skip(f"this CPU cannot run {isa} (it runs {', '.join(cpu24.isas())}); the emulated path tests its algorithm")


def quantized(out_f, in_f, seed=0):
    """(codes, bits, scales, dense dequantized fp64 [out_f, in_f]) of a random 2:4 weight."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g) * 3  # rows of other ranges
    w = w * reference.topn_mask(w, 2, 4, -1)
    w.view(-1)[:6] = 0  # groups with fewer than two non-zeros
    p = pack(w)
    values, bits = cpu24.cpu_layout(p.values, p.meta)
    codes, scales = quantize_layout(values, out_f)
    dense = cpu24.unpack(codes, bits, out_f).double() * scales.double()[:, None]
    return codes, bits, scales, dense, w


def check(y, x, dense, bias):
    rtol, atol = TOL[x.dtype]
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], dense.shape[0])
    expected = F.linear(x.double(), dense, None if bias is None else bias.double())
    torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=atol * dense.shape[1] ** 0.5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("tokens", [0, 1, 2, 3, 5, 17])
def test_every_path_dtype_and_token_count_matches_the_dequantized_product(isa, dtype, tokens):
    _skip_unless_runs(isa)
    codes, bits, scales, dense, _ = quantized(40, 48)
    bias = torch.randn(40).to(dtype)
    x = torch.randn(tokens, 48).to(dtype)
    y = torch.ops.nmsparse.cpu24_linear_q8(x, codes, bits, scales, bias, 40, -1, isa)
    check(y, x, dense, bias)


@pytest.mark.parametrize("isa", ISAS)
# one token reads K as 4 segments on AVX2: 80, 224, 240 and 1040 leave 1, 2, 3 and 1 words after them
@pytest.mark.parametrize("out_f,in_f", [(1, 16), (7, 32), (9, 80), (8, 224), (8, 240), (33, 1040)])
def test_shapes_at_the_alignment_edges_and_strided_inputs(isa, out_f, in_f):
    _skip_unless_runs(isa)
    codes, bits, scales, dense, _ = quantized(out_f, in_f, seed=out_f)
    for tokens in (1, 6):
        x = torch.randn(in_f, tokens).t()  # not contiguous
        check(torch.ops.nmsparse.cpu24_linear_q8(x, codes, bits, scales, None, out_f, -1, isa), x, dense, None)
        x3 = torch.randn(2, tokens, in_f, dtype=torch.bfloat16)
        check(torch.ops.nmsparse.cpu24_linear_q8(x3, codes, bits, scales, None, out_f, -1, isa), x3, dense, None)


@pytest.mark.parametrize("dtype", list(TOL))
def test_calls_past_max_tokens_take_the_dense_gemm_on_the_dequantized_weight(dtype):
    codes, bits, scales, dense, _ = quantized(24, 64)
    bias = torch.randn(24).to(dtype)
    x = torch.randn(5, 64).to(dtype)
    op = torch.ops.nmsparse.cpu24_linear_q8
    dense_route = op(x, codes, bits, scales, bias, 24, 4, "avx2" if "avx2" in cpu24.isas() else "emulated512")
    # the dense route rounds the dequantized weight to the input's dtype first
    expected = F.linear(x.double(), dense.to(dtype).double(), bias.double())
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(dense_route.double(), expected, rtol=rtol, atol=atol * 8)
    assert dense_route.dtype == dtype


def test_nan_and_inf_inputs_reach_the_outputs_as_in_the_dense_product():
    codes, bits, scales, dense, _ = quantized(16, 32)
    x = torch.randn(3, 32)
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    for isa in [i for i in ISAS if i == "emulated512" or i in cpu24.isas()]:
        y = torch.ops.nmsparse.cpu24_linear_q8(x, codes, bits, scales, None, 16, -1, isa)
        expected = F.linear(x.double(), dense)
        assert torch.equal(torch.isnan(y), torch.isnan(expected)), isa
        assert torch.equal(torch.isinf(y), torch.isinf(expected)), isa
        finite = torch.isfinite(expected)
        torch.testing.assert_close(y.double()[finite], expected[finite], rtol=1e-5, atol=1e-3)


def test_bad_arguments_are_named():
    codes, bits, scales, _, w = quantized(16, 32)
    op = torch.ops.nmsparse.cpu24_linear_q8
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="scales must be a contiguous fp32"):
        op(x, codes, bits, scales.double(), None, 16, -1, "emulated512")
    with pytest.raises(RuntimeError, match="scales must be"):
        op(x, codes, bits, scales[:8], None, 16, -1, "emulated512")
    with pytest.raises(RuntimeError, match="takes int8 values"):
        p = pack(w)
        op(x, *cpu24.cpu_layout(p.values, p.meta), scales, None, 16, -1, "emulated512")
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16 inputs"):
        op(x.double(), codes, bits, scales, None, 16, -1, "emulated512")
    with pytest.raises(RuntimeError, match="bf16 pairs"):
        op(x, codes, bits, scales, None, 16, -1, "emulated512_bf16")
    with pytest.raises(RuntimeError, match="in_features"):
        op(torch.randn(2, 48), codes, bits, scales, None, 16, -1, "emulated512")


def test_rows_round_to_nearest_on_a_symmetric_grid():
    codes, bits, scales, dense, w = quantized(21, 64)
    exact = w.double()
    top = exact.abs().amax(1)
    torch.testing.assert_close(scales.double(), torch.where(top > 0, top / LEVELS, torch.ones_like(top)))
    assert codes.dtype == torch.int8 and int(codes.min()) >= -LEVELS and int(codes.max()) <= LEVELS
    # each kept value within half a step of its row's grid, the largest one exactly at +-127
    assert bool(((dense - exact).abs() <= scales.double()[:, None] / 2 * (1 + 1e-6)).all())
    unpacked = cpu24.unpack(codes, bits, 21)
    assert bool((unpacked.abs().amax(1)[top > 0] == LEVELS).all())
    assert torch.equal(unpacked != 0, (dense != 0))  # no new non-zero: still 2:4


def test_a_row_of_zeros_gets_scale_one_and_a_row_of_nan_is_refused():
    rows = torch.zeros(3, 8)
    rows[1, 2] = -2.54
    assert torch.equal(row_scales(rows), torch.tensor([1.0, 2.54 / LEVELS, 1.0]))
    rows[2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[2\] hold NaN"):
        row_scales(rows)


# --------------------------------------------------------------------------- dense int8 rows (the output head)


def dense_quantized(out_f, in_f, seed=0):
    from nmcompile.kernels.cpu24.quantize import dense_rows, quantize_dense

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g)
    values, scales = quantize_dense(w)
    return values, scales, dense_rows(values, out_f).double() * scales.double()[:, None], w


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", list(TOL))
# K = 80, 224, 240, 1040: 1, 2, 3 and 1 words after the four segments of one token
@pytest.mark.parametrize("out_f,in_f", [(1, 16), (7, 32), (9, 80), (8, 224), (17, 240), (33, 1040)])
def test_dense_int8_rows_match_the_dequantized_product(isa, dtype, out_f, in_f):
    _skip_unless_runs(isa)
    values, scales, dense, _ = dense_quantized(out_f, in_f, seed=in_f)
    bias = torch.randn(out_f).to(dtype)
    for tokens in (0, 1, 2, 5):
        x = torch.randn(tokens, in_f).to(dtype)
        check(torch.ops.nmsparse.cpu24_dense_q8(x, values, scales, bias, out_f, -1, isa), x, dense, bias)
    x = torch.randn(in_f, 3).t().to(dtype)  # strided
    check(torch.ops.nmsparse.cpu24_dense_q8(x, values, scales, None, out_f, -1, isa), x, dense, None)


def test_dense_int8_rows_round_to_nearest_and_take_the_dense_gemm_past_max_tokens():
    values, scales, dense, w = dense_quantized(21, 64)
    assert bool(((dense - w.double()).abs() <= scales.double()[:, None] / 2 * (1 + 1e-6)).all())
    x = torch.randn(6, 64)
    op = torch.ops.nmsparse.cpu24_dense_q8
    isa = "avx2" if "avx2" in cpu24.isas() else "emulated512"
    check(op(x, values, scales, None, 21, 2, isa), x, dense, None)
    with pytest.raises(RuntimeError, match=r"expected contiguous int8 CPU values \[groups, K/16, 8, 16\]"):
        op(x, values.float(), scales, None, 21, -1, isa)
    with pytest.raises(RuntimeError, match="out_features 30 does not fit 3 groups"):
        op(x, values, torch.ones(30), None, 30, -1, isa)
    with pytest.raises(ValueError, match="in_features 40 is not a multiple of 16"):
        from nmcompile.kernels.cpu24.quantize import quantize_dense

        quantize_dense(torch.randn(4, 40))
