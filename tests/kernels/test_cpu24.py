"""The 2:4 CPU kernel against the dense product of the unpacked weight: every ISA path, dtype, edge shape.

The AVX-512 algorithm runs on any CPU through its emulated instantiation (the same kernel template
over plain arrays); the AVX-512 intrinsics themselves run where the CPU has them.
"""

import pytest
import torch
import torch.nn.functional as F

import reference
from nmcompile import pack
from nmcompile.kernels import cpu24

pytestmark = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) against a float64 product of the same (rounded) operands: fp32 accumulation, then the
# output rounded to the dtype
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2**-7, 2e-3), torch.float16: (2**-10, 2e-3)}


def _paths(dtype):
    """ISA paths for ``dtype``: those this CPU runs, plus the emulated AVX-512 ones (run everywhere)."""
    here = [isa for isa in cpu24.isas() if isa != "avx512_bf16" or dtype == torch.bfloat16]
    emulated = ["emulated512"] + (["emulated512_bf16"] if dtype == torch.bfloat16 else [])
    return here + emulated


#: (isa, dtype) pairs: the bf16-pair paths take bf16 only
PATH_DTYPES = [
    (isa, dtype) for isa in ("avx2", "avx512", "avx512_bf16", "emulated512", "emulated512_bf16") for dtype in DTYPES
    if dtype == torch.bfloat16 or not isa.endswith("bf16")
]


def _skip_unless_runs(isa, dtype):
    if not isa.startswith("emulated") and isa not in cpu24.isas():
        pytest.skip(f"this CPU cannot run {isa} (it runs {', '.join(cpu24.isas())}); the emulated path tests its algorithm")


def pruned(out_f, in_f, dtype):
    w = torch.randn(out_f, in_f)
    w = (w * reference.topn_mask(w, 2, 4, -1)).to(dtype)
    w.view(-1)[:6] = 0  # groups with fewer than two non-zeros
    return w


def layout(w):
    p = pack(w)
    return cpu24.cpu_layout(p.values, p.meta)



def check(y, x, w, bias):
    rtol, atol = TOL[x.dtype]
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    torch.testing.assert_close(y.double(), F.linear(x.double(), w.double(), None if bias is None else bias.double()),
                               rtol=rtol, atol=atol * w.shape[1] ** 0.5)


@pytest.mark.parametrize("isa,dtype", PATH_DTYPES)
@pytest.mark.parametrize("tokens", [0, 1, 2, 3, 4, 5, 17, 255])  # avx512 runs 1-2 on the AVX2 rows
def test_every_path_and_token_count_matches_the_dense_product(isa, dtype, tokens):
    _skip_unless_runs(isa, dtype)
    w, bias = pruned(40, 48, dtype), torch.randn(40).to(dtype)
    values, bits = layout(w)
    x = torch.randn(tokens, 48).to(dtype)
    y = torch.ops.nmsparse.cpu24_linear(x, values, bits, bias, None, 40, -1, isa)
    check(y, x, w, bias)


@pytest.mark.parametrize("isa,dtype", PATH_DTYPES)
# one token reads K as 4 segments at once on AVX2 (cpu24_kernel.h): 80, 224, 240 and 1040 leave 1,
# 2, 3 and 1 words after the segments
@pytest.mark.parametrize("out_f,in_f", [(1, 16), (7, 16), (7, 32), (1, 48), (16, 48), (9, 80), (8, 224), (8, 240), (33, 1040)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_shapes_at_the_alignment_edges(isa, dtype, out_f, in_f, with_bias):
    _skip_unless_runs(isa, dtype)
    w = pruned(out_f, in_f, dtype)
    bias = torch.randn(out_f).to(dtype) if with_bias else None
    values, bits = layout(w)
    for tokens in (1, 6):
        x = torch.randn(tokens, in_f).to(dtype)
        check(torch.ops.nmsparse.cpu24_linear(x, values, bits, bias, None, out_f, -1, isa), x, w, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_avx512_runs_one_or_two_tokens_on_the_avx2_rows(dtype):
    if "avx512" not in cpu24.isas():
        pytest.skip(f"this CPU cannot run avx512 (it runs {', '.join(cpu24.isas()) or 'no path'})")
    values, bits = layout(pruned(64, 1040, dtype))
    op = torch.ops.nmsparse.cpu24_linear
    for tokens in (1, 2, 3, 5):
        x = torch.randn(tokens, 1040).to(dtype)
        same = torch.equal(op(x, values, bits, None, None, 64, -1, "avx512"), op(x, values, bits, None, None, 64, -1, "avx2"))
        if tokens <= 2:
            assert same, tokens
        elif dtype == torch.float32:  # the AVX-512 rows sum 16 lanes, in another order than 8: other roundings
            assert not same, tokens


def test_the_default_isa_per_dtype():
    here = cpu24.isas()
    if not here:
        pytest.skip("no 2:4 CPU kernel here")
    assert cpu24.best_isa(torch.bfloat16) == "avx2"  # every CPU the kernel runs on has it
    wide = "avx512" if "avx512" in here else "avx2"
    assert cpu24.best_isa(torch.float32) == cpu24.best_isa(torch.float16) == wide


@pytest.mark.parametrize("isa,dtype", PATH_DTYPES)
def test_wide_rows_span_several_token_panels(isa, dtype):
    # panels hold 4x the core's L2 of activations (2 MB on a 512 KB L2): 255 tokens of 11008 fp32
    # activations (11 MB) take several panels and a remainder of fewer tokens than a tile
    _skip_unless_runs(isa, dtype)
    w, bias = pruned(9, 11008, dtype), torch.randn(9).to(dtype)
    values, bits = layout(w)
    x = torch.randn(255, 11008).to(dtype)
    check(torch.ops.nmsparse.cpu24_linear(x, values, bits, bias, None, 9, -1, isa), x, w, bias)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_and_two_threads_on_a_layer_large_enough_to_split(threads, dtype):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, bias = pruned(520, 256, dtype), torch.randn(520).to(dtype)  # 65 groups of 8 rows
        values, bits = layout(w)
        for isa in _paths(dtype):
            for tokens in (1, 9):
                x = torch.randn(tokens, 256).to(dtype)
                check(torch.ops.nmsparse.cpu24_linear(x, values, bits, bias, None, 520, -1, isa), x, w, bias)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_3d_and_non_contiguous_inputs(dtype):
    w, bias = pruned(24, 64, dtype), torch.randn(24).to(dtype)
    values, bits = layout(w)
    wide = torch.randn(2, 5, 128).to(dtype)
    for x in (wide[..., :64], wide[..., ::2], wide.transpose(0, 1)[..., 64:], wide[:, :3, :64].contiguous()):
        for isa in _paths(dtype):
            check(torch.ops.nmsparse.cpu24_linear(x, values, bits, bias, None, 24, -1, isa), x, w, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layout_round_trip_and_unpack_are_exact(dtype):
    w = pruned(13, 96, dtype)
    p = pack(w)
    values, bits = cpu24.cpu_layout(p.values, p.meta)
    assert values.shape == (2, 6, cpu24.GROUP, 8) and bits.shape == (2, 6, cpu24.GROUP)
    assert values.numel() * values.element_size() + bits.numel() * 2 == pytest.approx(
        p.nbytes * 16 / 13, rel=1e-9)  # the packed bytes plus 3 padding rows
    back = cpu24.packed_layout(values, bits, 13)
    assert torch.equal(back[0], p.values) and torch.equal(back[1], p.meta)
    assert torch.equal(cpu24.unpack(values, bits, 13), w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_pack_makes_the_layout_of_pack_in_one_pass(dtype):
    torch.manual_seed(0)
    for rows, cols in ((13, 48), (64, 32), (1, 16)):
        w = torch.randn(rows, cols).to(dtype)
        w[torch.rand(rows, cols) < 0.6] = 0  # groups of every kind, more than two non-zeros included
        p = pack(w, check=False)
        values, bits, over = cpu24.cpu_pack(w.t().contiguous().t())  # strides of a transposed read
        expected = cpu24.cpu_layout(p.values, p.meta)
        assert torch.equal(values, expected[0]) and torch.equal(bits, expected[1])
        assert over == int(((w != 0).reshape(rows, -1, 4).sum(-1) > 2).sum())
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu24.cpu_pack(torch.zeros(4, 12))


def test_bits_encode_the_kept_positions_by_hand():
    w = torch.zeros(1, 16)
    w[0, [0, 1]], w[0, [4, 6]], w[0, [9, 10]], w[0, [14, 15]] = 1.0, 2.0, 3.0, 4.0
    _, bits = layout(w)
    word = 0b0011 | 0b0101 << 4 | 0b0110 << 8 | 0b1100 << 12
    assert bits[0, 0, 0].item() == word - (1 << 16)  # int16
    assert bits[0, 0, 1:].eq(0x3333).all()  # padding rows keep positions 0 and 1, with zero values


@pytest.mark.parametrize("resident", [True, False])
def test_calls_above_max_tokens_take_the_dense_gemm(resident):
    w, bias = pruned(16, 32, torch.float32), torch.randn(16)
    values, bits = layout(w)
    x = torch.randn(9, 32)
    weight = w if resident else None
    y = torch.ops.nmsparse.cpu24_linear(x, values, bits, bias, weight, 16, 8, cpu24.best_isa(torch.float32))
    assert torch.equal(y, F.linear(x, w, bias))  # the dense kernel itself, bit for bit
    y_sparse = torch.ops.nmsparse.cpu24_linear(x, values, bits, bias, weight, 16, 9, cpu24.best_isa(torch.float32))
    check(y_sparse, x, w, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_dense_route_of_packed_weights_of_several_sizes_in_turn(dtype):
    # a packed-only weight above max_tokens is unpacked into the calling thread's kept buffer: a larger
    # weight grows it, a smaller one uses its start, and each product is the dense one bit for bit
    layers = [pruned(out_f, in_f, dtype) for out_f, in_f in ((64, 96), (24, 32), (130, 160), (24, 32), (64, 96))]
    for w in layers:
        values, bits = layout(w)
        x = torch.randn(5, w.shape[1]).to(dtype)
        y = torch.ops.nmsparse.cpu24_linear(x, values, bits, None, None, w.shape[0], 0, cpu24.best_isa(dtype))
        assert torch.equal(y, F.linear(x, w)), w.shape
        assert torch.equal(cpu24.unpack(values, bits, w.shape[0]), w)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("resident", [True, False])
def test_gradients_with_and_without_bias_and_resident_weight(with_bias, resident):
    w = pruned(24, 48, torch.float32)
    values, bits = layout(w)
    bias = torch.randn(24, requires_grad=True) if with_bias else None
    weight = w.clone().requires_grad_() if resident else None
    x = torch.randn(2, 5, 48, requires_grad=True)
    y = torch.ops.nmsparse.cpu24_linear(x, values, bits, bias, weight, 24, -1, cpu24.best_isa(torch.float32))
    assert y.grad_fn is not None
    (y * torch.linspace(-1, 1, 24)).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.clone().requires_grad_()
    b2 = bias.detach().clone().requires_grad_() if with_bias else None
    (F.linear(x2, w2, b2) * torch.linspace(-1, 1, 24)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    if with_bias:
        torch.testing.assert_close(bias.grad, b2.grad, rtol=1e-5, atol=1e-5)
    if resident:
        torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # nothing recorded, the same values
        y_off = torch.ops.nmsparse.cpu24_linear(x, values, bits, bias, weight, 24, -1, cpu24.best_isa(torch.float32))
    assert y_off.grad_fn is None and torch.equal(y_off, y.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 1400])
def test_a_reduced_dtype_is_the_fp32_product_rounded_to_nearest_even(dtype, tokens):
    """bf16 inputs are widened and the fp32 sums narrowed by the op's own loops up to 65536 values
    (1 and 5 tokens; 1400 x 48 takes ``Tensor.to``, as fp16 always does): the same bits as the fp32
    kernel on the same (exactly widened) operands, rounded as ``Tensor.to`` rounds (a NaN stays a NaN,
    its payload aside). K = 48 pads to 64."""
    w = pruned(16, 48, dtype)
    x = torch.randn(tokens, 48).to(dtype)
    x[0, :2] = torch.tensor([65504.0, -0.0]).to(dtype)
    if tokens > 1:
        x[-1, 5] = float("nan")  # a token whose every output is NaN (0 x NaN, as in F.linear)
    isa = "avx2" if "avx2" in cpu24.isas() else "emulated512"
    y = torch.ops.nmsparse.cpu24_linear(x, *layout(w), None, None, 16, -1, isa)
    want = torch.ops.nmsparse.cpu24_linear(x.float(), *layout(w.float()), None, None, 16, -1, isa).to(dtype)
    kept = tokens - (tokens > 1)
    assert y.dtype == dtype and y[kept:].isnan().all() and want[kept:].isnan().all()
    assert torch.equal(y[:kept].view(torch.int16), want[:kept].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    w, bias = pruned(16, 32, dtype), torch.randn(16).to(dtype)
    values, bits = layout(w)
    x = torch.randn(2, 3, 32).to(dtype)
    torch.library.opcheck(torch.ops.nmsparse.cpu24_linear.default,
                          (x, values, bits, bias, None, 16, -1, cpu24.best_isa(dtype)))
    torch.library.opcheck(torch.ops.nmsparse.cpu24_unpack.default, (values, bits, 16))


def test_errors_name_the_problem():
    w = pruned(16, 32, torch.float32)
    values, bits = layout(w)
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="unknown isa 'sse9'"):
        torch.ops.nmsparse.cpu24_linear(x, values, bits, None, None, 16, -1, "sse9")
    with pytest.raises(RuntimeError, match="input dtype"):
        torch.ops.nmsparse.cpu24_linear(x.double(), values, bits, None, None, 16, -1, "emulated512")
    with pytest.raises(RuntimeError, match="in_features 32"):
        torch.ops.nmsparse.cpu24_linear(torch.randn(2, 48), values, bits, None, None, 16, -1, "emulated512")
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.nmsparse.cpu24_linear(x, values, bits, None, None, 17, -1, "emulated512")
    with pytest.raises(RuntimeError, match="takes bf16"):
        torch.ops.nmsparse.cpu24_linear(x, values, bits, None, None, 16, -1, "emulated512_bf16")
    with pytest.raises(ValueError, match="cpu_layout takes"):
        cpu24.cpu_layout(values, bits)
    with pytest.raises(RuntimeError, match="fp32, bf16, fp16 or int8 weights, got Int"):  # unpacked by bits, not blindly
        torch.ops.nmsparse.cpu24_unpack(values.view(torch.int32), bits, 16)
    missing = [isa for isa in cpu24.ISAS if isa not in cpu24.isas()]
    if missing:
        with pytest.raises(RuntimeError, match=f"cannot run isa '{missing[-1]}'"):
            torch.ops.nmsparse.cpu24_linear(x, values, bits, None, None, 16, -1, missing[-1])


def test_the_build_is_named_for_its_torch_installation_and_compiler(monkeypatch, tmp_path):
    """Two environments (another torch installation, another compiler) build beside each other under
    other names: one name built by both was rebuilt by each for the other in turn."""
    here = cpu24._library_name()
    assert here == cpu24._library_name()  # the same environment: the same name, no rebuild
    other_torch = tmp_path / "venv2" / "torch"
    other_torch.mkdir(parents=True)
    monkeypatch.setattr(cpu24.torch, "__file__", str(other_torch / "__init__.py"))
    assert cpu24._library_name() != here
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "no-such-compiler-nmcompile")
    assert cpu24._library_name() != here
