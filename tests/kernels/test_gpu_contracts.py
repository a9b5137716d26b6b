"""nmcompile's GPU kernel calls against the contracts of PyTorch's CUDA 2:4 ops, on the CPU.

The first part checks the stand-in itself (tests/_gpu_contracts.py) on what the CUDA sources say:
the layout from ``is_contiguous()`` alone, the dims it refuses, no dtype check. The second part
reproduces each finding of the review (docs/benchmarks-history.md, "What the CPU stand-in proves") on
nmcompile's ops: token counts off the multiple of 8, non-contiguous inputs, autocast, the CUTLASS
reduction dim, the host sync of a checked pack, the compute-capability rule.
"""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import nmcompile
from nmcompile.kernels import dispatch
from nmcompile.kernels.dispatch import TOKEN_LADDER, kernel_unavailable, qualify
from nmcompile.kernels.deploy_op import DENSE_MULTIPLE, compress, padded_tokens
from nmcompile.kernels.dispatch.train import TrainKernelError, decide

from _gpu_contracts import ContractError, emulated_gpu

BF16 = torch.bfloat16
sparse_linear = torch.ops.nmsparse.sparse_linear
mm = torch.ops.nmsparse.sparse24_mm


def pruned(rows, cols, dtype=BF16):
    return nmcompile.masks.prune(torch.randn(rows, cols), 2, 4, 1).to(dtype)


def close(out, expected):
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.02)


# ---- the stand-in models the CUDA sources


def test_cslt_reads_any_non_contiguous_operand_as_column_major_with_ld_k():
    a, b = pruned(32, 64), torch.randn(64, 16).to(BF16)
    with emulated_gpu() as emu:
        values = torch._cslt_compress(a)
        assert values.shape == (32 * 64 * 9 // 16,) and values.dtype == BF16
        close(torch._cslt_sparse_mm(values, b), a.float() @ b.float())  # row-major
        close(torch._cslt_sparse_mm(values, b.t().contiguous().t()), a.float() @ b.float())  # column-major
        wide = torch.randn(64, 48).to(BF16)
        sliced = wide[:, :16]  # neither: read as column-major with ld = 64, not its strides
        wrong = torch._cslt_sparse_mm(values, sliced)
        assert (wrong.float() - a.float() @ sliced.float()).abs().max() > 1.0
        assert [c.layout for c in emu.calls if c.op == "cslt_sparse_mm"] == ["row", "col", "col"]


def test_cslt_refuses_dense_dims_off_its_multiples_and_checks_no_dtypes():
    a = pruned(32, 64)
    with emulated_gpu():
        values = torch._cslt_compress(a)
        with pytest.raises(ContractError, match="dense cols/ld \\(n\\) = 12 is not a multiple of 8"):
            torch._cslt_sparse_mm(values, torch.randn(64, 12).to(BF16))
        with pytest.raises(ContractError, match="dense rows \\(n\\) = 4 is not a multiple of 8"):
            torch._cslt_sparse_mm(values, torch.randn(4, 64).to(BF16).t(), transpose_result=True)
        with pytest.raises(ContractError, match="structured cols = 40"):
            torch._cslt_compress(pruned(32, 40))
        # fp32 B with a bf16 A: no check; B's memory is read as bf16 and the result is garbage in fp32
        b = torch.randn(64, 16)
        garbage = torch._cslt_sparse_mm(values, b)
        assert garbage.dtype == torch.float32
        assert not torch.allclose(garbage, a.float() @ b, atol=1.0)


def test_cslt_compress_prunes_silently_and_cutlass_checks_its_operands():
    dense = torch.randn(32, 64).to(BF16)  # not 2:4: cuSPARSELt compresses it anyway
    with emulated_gpu(capability=(8, 0)) as emu:
        values = torch._cslt_compress(dense)
        out = torch._cslt_sparse_mm(values, torch.eye(64, dtype=BF16))
        assert (out != 0).reshape(32, 16, 4).sum(-1).max() <= 2 and not torch.equal(out, dense)
        a = pruned(32, 64)
        v, meta = nmcompile.pack(a).cutlass()
        b = torch.randn(64, 8).to(BF16)
        close(torch._sparse_semi_structured_mm(v, meta, b), a.float() @ b.float())
        close(torch._sparse_semi_structured_mm(v, meta, b.t().contiguous().t()), a.float() @ b.float())
        with pytest.raises(ContractError, match="Invalid strides for mat2"):
            torch._sparse_semi_structured_mm(v, meta, torch.randn(64, 16).to(BF16)[:, ::2])
        with pytest.raises(ContractError, match="Expected mat1 datatype torch.float32"):
            torch._sparse_semi_structured_mm(v, meta, b.float())
        with pytest.raises(ContractError, match="other dim 12 is not a multiple of 8"):
            torch._sparse_semi_structured_mm(v, meta, torch.randn(64, 12).to(BF16))
        assert emu.names().count("sparse_semi_structured_mm") == 2
    with emulated_gpu(capability=(9, 0)):
        with pytest.raises(ContractError, match="compute capability 8.x"):
            torch._sparse_semi_structured_mm(v, meta, b)


def test_the_patches_end_with_the_block():
    real = torch._cslt_sparse_mm
    with emulated_gpu():
        assert torch._cslt_sparse_mm is not real and torch.backends.cusparselt.is_available()
    assert torch._cslt_sparse_mm is real and dispatch.kernel_unavailable is kernel_unavailable


# ---- finding 1: token counts that are not a multiple of 8


def _deploy_operands(dtype=BF16, out_f=64, in_f=64):
    w = pruned(out_f, in_f).to(dtype)
    values, meta = compress(w, "cusparselt")
    return w, values, meta, torch.randn(out_f).to(dtype)


@pytest.mark.parametrize("shape", [(1, 64), (197, 64), (65, 64), (3, 7, 64)])
def test_any_token_count_runs_on_cusparselt_padded_to_a_multiple_of_8(shape):
    with emulated_gpu() as emu:
        w, values, meta, bias = _deploy_operands()
        x = torch.randn(*shape).to(BF16)
        out = sparse_linear(x, w, values, meta, bias, "cusparselt", 0, 0)
        close(out, F.linear(x.float(), w.float(), bias.float()))
        assert out.shape == (*shape[:-1], 64) and out.is_contiguous()
        (call,) = [c for c in emu.calls if c.op == "cslt_sparse_mm"]
        tokens = x.numel() // 64
        assert call.dims == (64, 64, padded_tokens(tokens)) and call.dims[2] % 8 == 0


def test_the_ladder_and_the_search_use_counts_cusparselt_takes():
    assert all(count % DENSE_MULTIPLE == 0 for count in TOKEN_LADDER)
    with emulated_gpu(faster_from=64) as emu:
        w, values, _, bias = _deploy_operands()
        decision = qualify(w, "auto", device_type="cuda")
        assert decision.kernel == "cusparselt", decision
        dynamic = dispatch.measure(decision, w, bias, values, None, 64)  # the ladder
        assert dynamic.kernel == "cusparselt" and dynamic.min_tokens == 64
        (search,) = [c for c in emu.calls if c.op == "cslt_sparse_mm_search"]
        assert search.dims[2] == TOKEN_LADDER[-1]
        timed = sorted({c.dims[2] for c in emu.calls if c.op == "cslt_sparse_mm"})
        assert timed == list(TOKEN_LADDER)
        emu.calls.clear()
        static = dispatch.measure(decision, w, bias, values, 197, 64)  # ViT's 197 tokens: run and searched at 200
        assert static.kernel == "cusparselt" and static.min_tokens == 0, static
        assert {c.dims[2] for c in emu.calls if c.op.startswith("cslt_sparse_mm")} == {200}
        x = torch.randn(65, 64).to(BF16)  # past min_tokens=64 but not a multiple of 8
        close(sparse_linear(x, w, values, values.new_empty(0), bias, "cusparselt", 0, dynamic.min_tokens),
              F.linear(x.float(), w.float(), bias.float()))


# ---- finding 2: non-contiguous inputs


@pytest.mark.parametrize("view", ["slice", "column", "transposed"])
def test_a_non_contiguous_input_gives_the_right_product(view):
    with emulated_gpu() as emu:
        w, values, meta, bias = _deploy_operands()
        big = torch.randn(16, 96).to(BF16)
        x = {"slice": big[:, :64], "column": torch.randn(16, 3, 64).to(BF16)[:, 0],
             "transposed": torch.randn(64, 16).to(BF16).t()}[view]
        assert not x.is_contiguous()
        close(sparse_linear(x, w, values, meta, bias, "cusparselt", 0, 0), F.linear(x.float(), w.float(), bias.float()))
        assert emu.names().count("cslt_sparse_mm") == 1


def test_the_training_gemm_takes_non_contiguous_operands_on_both_kernels():
    a = pruned(64, 64)
    b = torch.randn(64, 96).to(BF16)[:, :32]
    for kernel, capability in (("cusparselt", (9, 0)), ("cutlass", (8, 0))):
        with emulated_gpu(capability=capability) as emu:
            for transpose in (False, True):
                out = mm(a, b, None, kernel, transpose, "t")
                expected = a.float() @ b.float()
                close(out, expected.t() if transpose else expected)
            assert len([c for c in emu.calls if c.op != "cslt_compress"]) == 2


# ---- finding 3: autocast


def test_autocast_casts_the_input_and_keeps_the_compressed_weight():
    with emulated_gpu() as emu:
        w, values, meta, bias = _deploy_operands()
        x = torch.randn(8, 64)  # float32 under a bf16 autocast: eager F.linear runs in bf16
        with torch.autocast("cpu", dtype=BF16):
            out = sparse_linear(x, w, values, meta, bias, "cusparselt", 0, 0)
            expected = F.linear(x, w, bias)
        assert out.dtype == BF16 == expected.dtype
        close(out, expected)
        assert [c.dtypes for c in emu.calls if c.op == "cslt_sparse_mm"] == [(BF16, BF16)]
        emu.calls.clear()
        with torch.autocast("cpu", dtype=torch.float16):  # another 16-bit type: the dense GEMM
            out = sparse_linear(x, w, values, meta, bias, "cusparselt", 0, 0)
        assert out.dtype == torch.float16 and not emu.calls
        close(out, F.linear(x, w.float(), bias.float()))
    packed = nmcompile.pack(w)
    with torch.autocast("cpu", dtype=BF16):
        out = sparse_linear(x, w, packed.values, packed.meta, bias, "reference", 0, 0)
    assert out.dtype == BF16


# ---- finding 4: a reduction dim of 16 x odd (fixed earlier; through the stand-in)


def test_a_reduction_dim_of_16_times_odd_never_reaches_cutlass():
    a, b = pruned(32, 48), torch.randn(48, 8).to(BF16)
    with emulated_gpu(capability=(8, 0)) as emu:
        for kernel in ("cutlass", "reference"):
            close(mm(a, b, None, kernel, False, "t"), a.float() @ b.float())  # dense, as misaligned
        assert emu.calls == []
        with pytest.raises(ValueError, match="last \\(reduction\\) dim divisible by 32"):
            nmcompile.pack(a).cutlass()


# ---- finding 5: no host sync on the kernel path


def test_the_cutlass_gemm_reads_nothing_back_to_the_host(monkeypatch):
    reads = []
    for name in ("__bool__", "__int__", "__float__", "item", "tolist"):
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _real=real, _name=name):
            reads.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(torch.Tensor, name, spy)
    a, b = pruned(64, 64), torch.randn(64, 32).to(BF16)
    with emulated_gpu(capability=(8, 0)) as emu:
        mm(a, b, torch.randn(64).to(BF16), "cutlass", True, "t")
        assert [c.op for c in emu.calls] == ["sparse_semi_structured_addmm"]
        assert reads == []
        nmcompile.pack(a)  # the checked pack (the reference kernel, nmcompile.pack) counts on the host
        assert reads


def test_an_unchecked_pack_keeps_the_shape_check_and_the_first_two_non_zeros():
    w = torch.tensor([[1.0, 2.0, 3.0, 0.0] * 4])
    with pytest.raises(ValueError, match="keep more than 2 non-zeros"):
        nmcompile.pack(w)
    assert torch.equal(nmcompile.unpack(nmcompile.pack(w, check=False)), torch.tensor([[1.0, 2.0, 0.0, 0.0] * 4]))
    with pytest.raises(ValueError, match="multiple of 16"):
        nmcompile.pack(torch.zeros(2, 8), check=False)


# ---- cuSPARSELt 0.8.0 on sm90: its fp16 search stopped the GPU (an H100 and an H200); algorithm 0 ran right


@pytest.mark.parametrize("dtype,capability,version,unsafe", [
    (torch.float16, (9, 0), 800, True), (torch.float16, (9, 0), 801, False), (torch.float16, (9, 0), None, False),
    (torch.float16, (8, 0), 800, False), (torch.float16, (10, 0), 800, False), (BF16, (9, 0), 800, False)])
def test_fp16_on_sm90_with_cusparselt_0_8_0_takes_algorithm_0_unsearched(dtype, capability, version, unsafe):
    from nmcompile.kernels.dispatch import search_unsafe

    why = search_unsafe(dtype, capability, version)
    assert (why is not None) == unsafe, why
    if unsafe:
        assert "cuSPARSELt 0.8.0's search failed in fp16 on sm90" in why and "algorithm 0" in why
    # fp16 is still a cuSPARSELt dtype there: only the search is left out
    assert kernel_unavailable("cusparselt", "cuda", dtype, cusparselt_available=True, capability=capability) is None


def test_the_deploy_timing_skips_the_search_where_it_is_unsafe():
    with emulated_gpu() as emu, mock.patch.object(torch.backends.cusparselt, "version", lambda: 800):
        w, values, _, bias = _deploy_operands(torch.float16)
        decision = dispatch.measure(qualify(w, "auto", device_type="cuda"), w, bias, values, 64, 64)
        assert decision.kernel == "cusparselt" and decision.alg_id == 0, decision
        assert "not searched" in decision.reason
        assert "cslt_sparse_mm_search" not in emu.names() and "cslt_sparse_mm" in emu.names()
        emu.calls.clear()
        w, values, _, bias = _deploy_operands()  # bf16 is searched
        dispatch.measure(qualify(w, "auto", device_type="cuda"), w, bias, values, 64, 64)
        assert "cslt_sparse_mm_search" in emu.names()


# ---- finding 6: compute capability


@pytest.mark.parametrize("capability,ok", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 6), True), ((9, 0), True)])
def test_cusparselt_needs_compute_capability_8_0(capability, ok):
    why = kernel_unavailable("cusparselt", "cuda", BF16, cusparselt_available=True, capability=capability)
    assert (why is None) == ok, why
    w = pruned(64, 64)
    decision = qualify(w, "auto", device_type="cuda", cusparselt_available=True, capability=capability)
    assert decision.kernel == ("cusparselt" if ok else "dense")
    if not ok:
        assert "compute capability 8.0 or newer" in why and f"sm{capability[0]}{capability[1]}" in why
        with pytest.raises(ValueError, match="deploy_kernel='cusparselt' cannot be used: cuSPARSELt's 2:4 kernels need"):
            qualify(w, "cusparselt", device_type="cuda", cusparselt_available=True, capability=capability)
        with emulated_gpu(capability=capability):  # the device rules read the GPU's capability
            assert qualify(w, "auto", device_type="cuda").kernel == "dense"
            with pytest.raises(ContractError, match="ARCH_MISMATCH"):  # what auto would have run into
                torch._cslt_compress(w)
        train = dict(layer="fc1.weight", not_24=None, rows=64, cols=64, n=64, dtype=BF16, device_type="cuda",
                     cusparselt_available=True, capability=capability)
        assert "need compute capability 8.0" in decide("auto", "forward", **train).reason
        with pytest.raises(TrainKernelError, match="train_kernel='cusparselt' cannot run the forward GEMM of 'fc1.weight'"):
            decide("cusparselt", "forward", **train)
