"""2:4 weights with 4-bit values (``nmsparse::cpu24_linear_q4``, the ``avx2_a8`` route) against the definition: the
values on 4-bit grids per row and group of positions (``reference.int4_groups``), the activations quantized in
blocks of 32, the integer products summed exactly, each block's product times its activation scale and its
group's weight scale (``reference.int8_activation_linear``)."""

import pytest
import torch
import torch.nn.functional as F

import reference
from nmcompile import pack
from nmcompile.kernels import cpu24
from nmcompile.kernels.cpu24.quantize import dense4, dense_rows4, position_index, quantize_dense4, quantize_layout4

pytestmark = pytest.mark.skipif("avx2" not in cpu24.isas(), reason="the 4-bit route needs AVX2")

A8 = cpu24.A8_ISA
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (out_features, in_features, group): padding rows (1, 9, 17, 33 rows), one to 64 steps, groups of one and two steps
SHAPES = [(1, 64, 64), (9, 128, 128), (8, 192, 64), (17, 256, 128), (33, 1024, 64), (24, 4096, 128)]


def weight4(out_f, in_f, group, seed=0, dtype=torch.float32):
    """(codes, index, scales) in the kernel's layout, and the reference's (codes [N, K], scales [N, K/group]) of a
    random 2:4 weight whose rows' magnitudes differ."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g)
    w = (w * reference.topn_mask(w, 2, 4, -1)).to(dtype)
    p = pack(w)
    values, bits = cpu24.cpu_layout(p.values, p.meta)
    codes, index, scales = quantize_layout4(values, bits, out_f, group)
    return codes, index, scales, reference.int4_groups(w, group)


def check(y, x, ref_codes, ref_scales, bias):
    """fp32 sums of exact block products, each times an fp32 product of two scales (a bound of K/8 fp32 roundings
    of the terms' magnitudes), then the output rounded to the input's dtype."""
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], ref_codes.shape[0])
    expected = reference.int8_activation_linear(x, ref_codes, ref_scales, bias)
    magnitude = reference.int8_activation_linear(x.abs(), ref_codes.abs(), ref_scales.abs(),
                                                 None if bias is None else bias.abs())
    eps = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}[x.dtype]
    bound = magnitude * (x.shape[-1] / 8 * 2**-24) + expected.abs() * eps + 1e-30
    assert bool(((y.double() - expected).abs() <= bound).all()), (y.double() - expected).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_f,in_f,group", SHAPES)
def test_4_bit_values_match_the_definition(dtype, out_f, in_f, group):
    codes, index, scales, (ref_codes, ref_scales) = weight4(out_f, in_f, group, seed=in_f, dtype=dtype)
    op = torch.ops.nmsparse.cpu24_linear_q4
    bias = torch.randn(out_f).to(dtype)
    for tokens in (0, 1, 2, 3, 5, 17):
        x = torch.randn(tokens, in_f).to(dtype)
        check(op(x, codes, index, scales, bias, out_f, group, -1, A8), x, ref_codes, ref_scales, bias)
    x = torch.randn(in_f, 3).t().to(dtype)  # strided
    check(op(x, codes, index, scales, None, out_f, group, -1, A8), x, ref_codes, ref_scales, None)
    x3 = torch.randn(2, 3, in_f).to(dtype)
    check(op(x3, codes, index, scales, None, out_f, group, -1, A8), x3, ref_codes, ref_scales, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_f,in_f,group", SHAPES)
def test_dense_4_bit_rows_match_the_definition(dtype, out_f, in_f, group):
    g = torch.Generator().manual_seed(in_f)
    w = (torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g)).to(dtype)
    values, scales = quantize_dense4(w, group)
    ref_codes, ref_scales = reference.int4_groups(w, group)
    assert torch.equal(dense_rows4(values, scales, group)[:out_f].double(),
                       ref_codes * ref_scales.repeat_interleave(group, dim=1))
    op = torch.ops.nmsparse.cpu24_dense_q4
    bias = torch.randn(out_f).to(dtype)
    for tokens in (0, 1, 2, 5, 9):
        x = torch.randn(tokens, in_f).to(dtype)
        check(op(x, values, scales, bias, out_f, group, -1, A8), x, ref_codes, ref_scales, bias)
    x = torch.randn(6, in_f).to(dtype)  # past max_tokens: the dense GEMM on the dequantized weight
    w4 = (ref_codes * ref_scales.repeat_interleave(group, dim=1)).to(dtype)
    assert torch.equal(op(x, values, scales, bias, out_f, group, 5, A8), F.linear(x, w4, bias))


@pytest.mark.parametrize("group", (64, 128))
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layout_holds_the_definitions_grid(group, dtype):
    codes, index, scales, (ref_codes, ref_scales) = weight4(21, 512, group, seed=3, dtype=dtype)
    assert codes.dtype == torch.uint8 and index.dtype == torch.uint8 and scales.dtype == torch.float16
    assert codes.shape == (3, 512 // 64, 4, 32) and index.shape == (3, 8, 8, 8) and scales.shape == (3, 512 // group, 8)
    dense = dense4(codes, index, scales, group, 21).double()
    expected = ref_codes * ref_scales.repeat_interleave(group, dim=1)
    assert torch.equal(dense, expected)
    assert torch.equal(scales.transpose(1, 2).reshape(24, -1)[:21].double(), ref_scales)
    assert int(ref_codes.min()) == -8  # the value of largest magnitude of each group lands on -8
    assert bool((scales.transpose(1, 2).reshape(24, -1)[21:] == 0).all())  # padding rows: scale 0, codes 0


def test_calls_past_max_tokens_take_the_dense_gemm_on_the_dequantized_weight():
    codes, index, scales, (ref_codes, ref_scales) = weight4(24, 256, 64)
    w = ref_codes * ref_scales.repeat_interleave(64, dim=1)
    op = torch.ops.nmsparse.cpu24_linear_q4
    for dtype in DTYPES:
        x = torch.randn(5, 256).to(dtype)
        bias = torch.randn(24).to(dtype)
        assert torch.equal(op(x, codes, index, scales, bias, 24, 64, 4, A8), F.linear(x, w.to(dtype), bias))


def test_zero_groups_nan_activations_and_outliers():
    w = torch.randn(16, 256)
    w = w * reference.topn_mask(w, 2, 4, -1)
    w[3] = 0  # a row of zeros: scales 0, codes 0
    w[5, 64:128] = 0  # one group of zeros
    w[7, 10] = 100.0  # an outlier: its group's scale only
    p = pack(w)
    values, bits = cpu24.cpu_layout(p.values, p.meta)
    codes, index, scales = quantize_layout4(values, bits, 16, 64)
    ref_codes, ref_scales = reference.int4_groups(w, 64)
    assert float(ref_scales[3].abs().max()) == 0.0 and float(ref_scales[5, 1]) == 0.0
    x = torch.randn(3, 256)
    x[1, 100] = float("nan")
    bias = torch.randn(16)
    y = torch.ops.nmsparse.cpu24_linear_q4(x, codes, index, scales, bias, 16, 64, -1, A8)
    assert bool(torch.isnan(y[1]).all())
    check(y[[0, 2]], x[[0, 2]], ref_codes, ref_scales, bias)
    assert torch.equal(y[[0, 2], 3], bias[3].expand(2))


def test_bad_layouts_groups_and_isas_are_refused_by_name():
    codes, index, scales, _ = weight4(16, 128, 64)
    op = torch.ops.nmsparse.cpu24_linear_q4
    x = torch.randn(1, 128)
    with pytest.raises(RuntimeError, match="4-bit weights run on isa 'avx2_a8' only"):
        op(x, codes, index, scales, None, 16, 64, -1, "avx2")
    with pytest.raises(RuntimeError, match="group is 64 or 128"):
        op(x, codes, index, scales, None, 16, 32, -1, A8)
    with pytest.raises(RuntimeError, match=r"expected contiguous fp16 CPU scales \[2, 2, 8\]"):
        op(x, codes, index, scales.float(), None, 16, 64, -1, A8)
    with pytest.raises(RuntimeError, match="does not match the weight's in_features 128"):
        op(torch.randn(1, 64), codes, index, scales, None, 16, 64, -1, A8)
    with pytest.raises(RuntimeError, match=r"expected contiguous uint8 CPU values"):
        op(x, codes.view(torch.int8), index, scales, None, 16, 64, -1, A8)
    with pytest.raises(RuntimeError, match=r"expected a contiguous uint8 CPU index \[2, 2, 8, 8\]"):
        op(x, codes, index.view(torch.int16), scales, None, 16, 64, -1, A8)
    w = torch.randn(16, 96)
    p = pack(w * reference.topn_mask(w, 2, 4, -1))
    values, bits = cpu24.cpu_layout(p.values, p.meta)
    with pytest.raises(ValueError, match="in_features 96 is not a multiple of group=64"):
        quantize_layout4(values, bits, 16, 64)
    with pytest.raises(ValueError, match="group=32 is not supported"):
        quantize_layout4(values, bits, 16, 32)
    bad = values.clone()
    bad[0, 0, 2, 0] = float("inf")
    with pytest.raises(ValueError, match=r"rows \[2\] hold NaN or infinite weights"):
        quantize_layout4(torch.cat([bad, bad[:, :2]], 1), torch.cat([bits, bits[:, :2]], 1), 16, 64)


def test_the_index_holds_each_kept_values_position_in_its_group_of_four():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 128, generator=g)
    w = w * reference.topn_mask(w, 2, 4, -1)
    p = pack(w)
    _, bits = cpu24.cpu_layout(p.values, p.meta)
    index = position_index(bits)  # [2 groups, 2 steps, 8 rows, 8]
    for row in (0, 5, 11):
        for step in (0, 1):
            for word in range(4):
                positions = w[row, step * 64 + word * 16:][:16].nonzero().flatten().tolist()
                got = [4 * (j // 2) + ((int(index[row // 8, step, row % 8, j]) >> (2 * word)) & 3) for j in range(8)]
                assert got == positions, (row, step, word)


def test_round_groups4_is_the_grid_pack_weights_holds_and_a_given_grid_is_kept_or_refused():
    from nmcompile.kernels.cpu24.quantize import round_groups4

    g = torch.Generator().manual_seed(7)
    w = torch.randn(24, 256, generator=g)
    w = w * reference.topn_mask(w, 2, 4, -1)
    codes, scales = reference.int4_groups(w, 64)
    rounded = round_groups4(w, 64)
    assert torch.equal(rounded.double(), codes * scales.repeat_interleave(64, dim=1))
    p = pack(rounded)
    values, bits = cpu24.cpu_layout(p.values, p.meta)
    given = quantize_layout4(values, bits, 24, 64, scales.half())  # the values lie on that grid: its codes
    assert given is not None and torch.equal(dense4(*given, 64, 24), rounded)
    assert quantize_layout4(values * 1.3, bits, 24, 64, scales.half()) is None  # off the grid: refused
