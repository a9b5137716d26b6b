"""The training GEMM ops: the packed layout they take, their numerics and gradients against the
equations, the per-GEMM kernel decisions, and (on a GPU) cuSPARSELt and CUTLASS against the reference."""

import pytest
import torch
import torch.nn.functional as F
from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

import nmcompile
from nmcompile.kernels import train_gemms as training
from nmcompile.kernels.format24 import Packed24, cutlass_meta, row_meta
from nmcompile.kernels.dispatch.train import TrainKernelError, decide, measure
from nmcompile.masks import mvue

import reference

mm = torch.ops.nmsparse.sparse24_mm
linear = torch.ops.nmsparse.sparse_train_linear


def pruned(rows, cols, dtype=torch.float32, device="cpu"):
    w = torch.randn(rows, cols, device=device)
    return (w * reference.topn_mask(w, 2, 4, 1)).to(dtype)


# ---- the packed layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cutlass_metadata_order_round_trips_and_is_torch_s(dtype):
    w = pruned(64, 128, dtype)
    if dtype is not torch.float32:  # torch's converter reads fp32 as 1:2; for 16-bit values it is the same order
        assert torch.equal(cutlass_meta(nmcompile.pack(w).meta), sparse_semi_structured_from_dense_cutlass(w)[1])
    w[:, :8] = 0  # groups with fewer than two non-zeros (coded differently from torch's converter)
    packed = nmcompile.pack(w)
    reordered = cutlass_meta(packed.meta)
    assert not torch.equal(reordered, packed.meta)
    assert torch.equal(row_meta(reordered), packed.meta)
    assert torch.equal(nmcompile.unpack(Packed24.from_cutlass(packed.values, reordered)), w)
    with pytest.raises(ValueError, match="rows divisible by 32"):
        cutlass_meta(packed.meta[:16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("transpose_result", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_product_is_the_dense_product(dtype, transpose_result, with_bias):
    a, b = pruned(64, 32, dtype), torch.randn(32, 24).to(dtype)
    bias = torch.randn(64).to(dtype) if with_bias else None
    out = mm(a, b, bias, "reference", transpose_result, "test")
    expected = a.double() @ b.double() + (bias.double()[:, None] if with_bias else 0)
    expected = expected.t() if transpose_result else expected
    assert out.shape == expected.shape and out.dtype == dtype and out.is_contiguous()
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_reference_refuses_an_operand_that_is_not_2_4_and_names_it():
    with pytest.raises(ValueError, match="fc1.weight forward: the operand given to the 2:4 kernel is not 2:4"):
        mm(torch.randn(32, 32), torch.randn(32, 8), None, "reference", False, "fc1.weight forward")
    # a shape the kernel does not take (possible with dynamic shapes) is the dense product, unchecked
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    torch.testing.assert_close(mm(a, b, None, "reference", False, "x"), a @ b)
    assert training.misaligned("reference", 8, 16, 8) and "row count (8)" in training.misaligned("reference", 8, 16, 8)
    with pytest.raises(ValueError, match="unknown kernel 'fast'"):
        mm(pruned(32, 16), torch.randn(16, 8), None, "fast", False, "x")


@pytest.mark.parametrize("cols", [16, 48, 80])
def test_a_reduction_dim_of_16_times_odd_is_outside_the_cutlass_layout(cols):
    # CUTLASS's metadata order swaps words in pairs of columns: an odd word count scattered out of bounds
    a, b = pruned(32, cols), torch.randn(cols, 8)
    why = training.misaligned("reference", 32, cols, 8)
    assert why is not None and f"reduction dim ({cols}) is not a multiple of 32" in why
    torch.testing.assert_close(mm(a, b, None, "reference", False, "x"), a @ b)  # dense, as a misaligned call is
    assert training.misaligned("cutlass", 32, cols, 8) is not None  # PyTorch's CUTLASS kernels: by 64
    with pytest.raises(ValueError, match=rf"Packed24.cutlass of a \[32, {cols}\] weight: .*last \(reduction\) dim divisible by 32"):
        nmcompile.pack(pruned(32, cols, torch.float16)).cutlass()
    with pytest.raises(ValueError, match="last \\(reduction\\) dim divisible by 32"):
        row_meta(nmcompile.pack(a).meta)
    assert training.misaligned("reference", 32, 2 * cols, 8) is None  # the next multiple of 32 is taken


def test_train_kernel_rules_keep_16_times_odd_reduction_dims_dense_with_the_reason():
    for role, rows, cols in (("forward", 64, 48), ("forward", 64, 16), ("wgrad", 64, 48)):
        decision = decide("reference", role, layer="fc", not_24=None, rows=rows, cols=cols, n=32,
                          dtype=torch.float32, device_type="cpu")
        assert decision.kernel == "dense" and f"reduction dim ({cols}) is not a multiple of 32" in decision.reason


# ---- the training op: forward and gradients from the equations


def _grads(fn, x, w, bias, dy, seed=3):
    x, w, bias = (t.detach().clone().requires_grad_() for t in (x, w, bias))
    torch.manual_seed(seed)
    out = fn(x, w, bias)
    out.backward(dy)
    return out.detach(), x.grad, w.grad, bias.grad


@pytest.mark.parametrize("kernels", [("reference",) * 3, ("dense", "reference", "reference"), ("reference", "dense", "dense")])
def test_train_linear_matches_its_equations(kernels):
    torch.manual_seed(0)
    w = pruned(64, 32)
    w = w * reference.topn_mask(w.t(), 2, 4, 1).t()  # 2:4 along in and along out (not every row keeps 2)
    x, bias, dy = torch.randn(4, 8, 32), torch.randn(64), torch.randn(4, 8, 64)
    scale = torch.tensor(0.75)
    out, dx, dw, db = _grads(lambda x, w, b: linear(x, w, w, b, scale, None, None, 2, 4, False, *kernels, "t"), x, w, bias, dy)
    torch.testing.assert_close(out, scale * (x @ w.t()) + bias)  # beta scales the output
    torch.testing.assert_close(dx, scale * (dy @ w))
    torch.manual_seed(3)
    g = mvue(dy.reshape(32, 64), 2, 4, dim=0)  # the backward's only draw after the seed
    torch.testing.assert_close(dw, g.t() @ x.reshape(32, 32))  # the gradient of the effective weight
    torch.testing.assert_close(db, dy.sum((0, 1)))
    assert int((g.t().unflatten(1, (-1, 4)) != 0).sum(-1).max()) <= 2


def test_bi_mask_row_order_gives_the_same_input_gradient():
    torch.manual_seed(0)
    perm = torch.randperm(64)
    w_d = torch.empty(64, 32)
    w_d[perm] = pruned(32, 64).t().contiguous()  # 2:4 along out in the order perm, not as stored
    x, bias, dy = torch.randn(32, 32), torch.randn(64), torch.randn(32, 64)
    w = pruned(64, 32)
    fn = lambda x, w, b: linear(x, w, w_d, b, None, None, perm, 0, 0, False, "dense", "reference", "dense", "t")  # noqa: E731
    _, dx, dw, _ = _grads(fn, x, w, bias, dy)
    torch.testing.assert_close(dx, dy @ w_d)
    torch.testing.assert_close(dw, dy.t() @ x)
    without_order = lambda x, w, b: linear(x, w, w_d, b, None, None, None, 0, 0, False, "dense", "reference", "dense", "t")  # noqa: E731
    with pytest.raises(ValueError, match="t dgrad: .*not 2:4"):
        _grads(without_order, x, w, bias, dy)


def test_gate_off_takes_the_dense_forward_and_on_the_2_4_kernel():
    x, w = torch.randn(4, 32), torch.randn(64, 32)  # dense: STEP's weight before its switch
    off, on = torch.tensor(False), torch.tensor(True)
    args = (None, None, 0, 0, False, "reference", "dense", "dense", "step")
    torch.testing.assert_close(linear(x, w, w, None, None, off, *args[1:]), F.linear(x, w))
    with pytest.raises(ValueError, match="step forward: .*not 2:4"):
        linear(x, w, w, None, None, on, *args[1:])


def test_fp8_rounds_as_nmsparse_linear_does():
    torch.manual_seed(0)
    w, x, bias, dy = pruned(64, 32), torch.randn(32, 32), torch.randn(64), torch.randn(32, 64)
    sparse = _grads(lambda x, w, b: linear(x, w, w, b, None, None, None, 2, 4, True, "reference", "dense", "reference", "t"), x, w, bias, dy)
    dense = _grads(lambda x, w, b: torch.ops.nmsparse.linear(x, w, w, b, 2, 4, True), x, w, bias, dy)
    for a, b in zip(sparse, dense):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_autocast_runs_the_gemms_in_the_autocast_dtype():
    x, w = torch.randn(4, 32), pruned(64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x, w, w, None, None, None, None, 0, 0, False, "reference", "dense", "dense", "t")
    assert out.dtype == torch.bfloat16


def test_ops_pass_opcheck():
    torch.manual_seed(0)
    w, x, bias = pruned(64, 32), torch.randn(4, 8, 32, requires_grad=True), torch.randn(64, requires_grad=True)
    w = (w * reference.topn_mask(w.t(), 2, 4, 1).t()).requires_grad_()  # 2:4 along in and out
    torch.library.opcheck(mm, (pruned(64, 32), torch.randn(32, 16), torch.randn(64), "reference", True, "t"))
    for kernels in (("reference", "reference", "dense"), ("reference", "dense", "dense")):
        args = (x, w, w.detach(), bias, torch.tensor(0.5), None, None, 0, 0, False, *kernels, "t")
        torch.library.opcheck(linear, args)


# ---- decisions


def _decide(requested="auto", role="forward", **kw):
    args = dict(layer="fc1.weight", not_24=None, rows=64, cols=32, n=128, dtype=torch.float16, device_type="cuda",
                cusparselt_available=True, capability=(9, 0))
    args.update(kw)
    return decide(requested, role, **args)


@pytest.mark.parametrize(
    "requested,kw,kernel,reason",
    [
        ("dense", {}, "dense", "train_kernel='dense' was requested"),
        ("auto", {"not_24": "ste:2:4: not 2:4 along 'out'"}, "dense", "not 2:4 along 'out'"),
        ("reference", {"not_24": "why"}, "dense", "why"),
        ("auto", {"device_type": "cpu"}, "dense", "no 2:4 kernel on cpu"),
        ("auto", {"cusparselt_available": False}, "dense", "no cuSPARSELt"),
        ("auto", {"dtype": torch.float32}, "dense", "cast the model to fp16 or bf16"),
        ("auto", {}, "cusparselt", "qualify"),
        ("auto", {"rows": 40}, "dense", "row count (40) is not a multiple of 16"),
        ("auto", {"n": 12}, "dense", "(12) is not a multiple of 8"),
        ("auto", {"cols": None}, "dense", "dynamic"),
        ("cusparselt", {"cols": None}, "cusparselt", "take the dense GEMM"),
        ("reference", {"device_type": "cpu", "dtype": torch.float32}, "reference", "CUTLASS's layout"),
        ("reference", {"rows": 16}, "dense", "not a multiple of 32 (reference)"),
        ("cutlass", {"capability": (8, 0), "cols": 64}, "cutlass", "qualify"),
        ("cutlass", {"capability": (8, 0)}, "dense", "reduction dim (32) is not a multiple of 64"),
    ],
)
def test_decision_rules(requested, kw, kernel, reason):
    decision = _decide(requested, **kw)
    assert decision.kernel == kernel and reason in decision.reason, decision


@pytest.mark.parametrize(
    "requested,kw,why",
    [
        ("cusparselt", {"device_type": "cpu"}, "no 2:4 kernel on cpu"),
        ("cusparselt", {"dtype": torch.float32}, "cast the model"),
        ("cutlass", {}, "compute capability 8.x only, this GPU is sm90"),
    ],
)
def test_a_forced_kernel_that_cannot_run_names_the_layer_and_why(requested, kw, why):
    with pytest.raises(TrainKernelError, match=f"train_kernel='{requested}' cannot run the dgrad GEMM of 'fc1.weight': .*{why}"):
        _decide(requested, role="dgrad", **kw)


def test_measure_leaves_non_gpu_decisions_alone():
    decision = _decide("reference", device_type="cpu", dtype=torch.float32)
    assert measure(decision, "forward", rows=64, cols=32, n=128, dtype=torch.float32, device="cpu") is decision


# ---- the GPU kernels against the reference


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cusparselt", "cutlass"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("transpose_result", [False, True])
def test_gpu_kernels_match_the_reference(kernel, dtype, transpose_result):
    from nmcompile.kernels.dispatch import kernel_unavailable

    why = kernel_unavailable(kernel, "cuda", dtype)
    if why:
        pytest.skip(why)
    a, b = pruned(128, 256, dtype, "cuda"), torch.randn(256, 64, device="cuda").to(dtype)
    bias = torch.randn(128, device="cuda").to(dtype)
    for operand in (b, b.t().contiguous().t()):  # row- and column-major dense operands
        for bias_arg in (None, bias):
            out = mm(a, operand, bias_arg, kernel, transpose_result, "gpu")
            expected = mm(a, operand, bias_arg, "reference", transpose_result, "gpu")
            assert out.shape == expected.shape and out.dtype == dtype
            torch.testing.assert_close(out.float(), expected.float(), atol=0.1, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cusparselt", "cutlass"])
def test_gpu_train_linear_matches_the_reference_kernel(kernel):
    from nmcompile.kernels.dispatch import kernel_unavailable

    dtype = torch.bfloat16
    why = kernel_unavailable(kernel, "cuda", dtype)
    if why:
        pytest.skip(why)
    torch.manual_seed(0)
    w = pruned(256, 128, torch.float32, "cuda")
    w = (w * reference.topn_mask(w.t(), 2, 4, 1).t()).to(dtype)
    x, bias, dy = (torch.randn(*s, device="cuda").to(dtype) for s in ((2, 64, 128), (256,), (2, 64, 256)))
    results = {}
    for k in (kernel, "reference"):
        fn = lambda x, w, b: linear(x, w, w, b, None, None, None, 2, 4, False, k, k, k, "gpu")  # noqa: E731
        results[k] = _grads(fn, x, w, bias, dy)
    for got, want in zip(results[kernel], results["reference"]):
        torch.testing.assert_close(got.float(), want.float(), atol=0.25, rtol=0.03)


@pytest.mark.gpu
def test_gpu_measure_times_and_keeps_only_a_faster_kernel():
    if not torch.backends.cusparselt.is_available():
        pytest.skip("this torch build has no cuSPARSELt")
    for role in ("forward", "dgrad", "wgrad"):
        decision = _decide("auto", role=role, rows=1024, cols=1024, n=4096, capability=None, cusparselt_available=None,
                           dtype=torch.bfloat16)
        assert decision.kernel == "cusparselt", decision
        measured = measure(decision, role, rows=1024, cols=1024, n=4096, dtype=torch.bfloat16, device="cuda")
        assert measured.speedup is not None and measured.speedup > 0
        assert measured.sparse == (measured.speedup > 1.02), measured


def test_the_recipes_doc_gives_the_reference_kernel_s_alignment_as_the_code_does():
    import re
    from pathlib import Path

    from nmcompile.kernels.train_gemms import ALIGNMENT, misaligned

    text = " ".join((Path(__file__).parents[2] / "docs" / "recipes.md").read_text().split())
    rows, cols = map(int, re.search(r"the reference kernel (\d+) x (\d+)", text).groups())
    assert (rows, cols) == ALIGNMENT["reference"][:2]
    assert misaligned("reference", rows, cols, 8) is None and misaligned("reference", rows, cols // 2, 8) is not None
