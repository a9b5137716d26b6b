"""The whole GPU path through ``torch.compile(backend="nmsparse")`` on the CPU, against the CUDA ops'
contracts (tests/_gpu_contracts.py): every recipe trains with cuSPARSELt and CUTLASS and deploys
with cuSPARSELt, at static and dynamic token counts, on sliced inputs and under autocast, in bf16.

What this proves and what it does not: the calls nmcompile makes are ones the CUDA ops accept, and
read their operands as nmcompile means them (strides, dims, dtypes, metadata order); the results
equal the dense model's. Kernel speed, algorithm ids, CUDA-graph capture and sm90's own shape rules
are left to ``benchmarks/gpu/gpu_check.py`` on a GPU.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile
from nmcompile.recipes import RECIPES
from nmcompile.training import train_report

from _gpu_contracts import emulated_gpu

BF16 = torch.bfloat16
AOT = {"inner": "aot_eager"}
STEPS = 3
# every recipe, scheduled so that STEP switches and SDGF reaches 2:4 within STEPS; MVUE24 weight
# gradients where the recipe has them, so that every recipe runs a sparse GEMM from its first step
SPECS = {
    "ste": "ste:2:4,wgrad=mvue24",
    "sr_ste": "sr_ste:2:4",
    "s_ste": "s_ste:2:4,wgrad=mvue24",
    "step": f"step:2:4,total_steps={STEPS},t_max=0.34,beta2=0.999,wgrad=mvue24",
    "mdgf": f"mdgf:2:4,decay_coef=0.05,finetune_fraction=0.5,total_steps={STEPS},wgrad=mvue24",
    "sdgf": f"sdgf:2:4,total_steps={STEPS},wgrad=mvue24",
    "bi_mask": "bi_mask:2:4,every=2,candidates=4",
    "transposable": "transposable:2:4,every=2,wgrad=mvue24",
    "asp": "asp:2:4",
    "wanda": "wanda:2:4",  # one-shot: trains dense while its statistics gather, deploys once finalized
    "sparsegpt": "sparsegpt:2:4,blocksize=16",
}
TRAINED = [name for name in SPECS if not RECIPES[name].calibrated]  # one-shot recipes train dense
SPARSE_CALLS = ("cslt_sparse_mm", "sparse_semi_structured_mm", "sparse_semi_structured_addmm")


def test_every_recipe_is_covered():
    assert set(SPECS) == set(RECIPES)


class Sliced(nn.Module):
    """Reads its layers' inputs through slices: the GEMMs get non-contiguous operands."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 32)

    def forward(self, h):
        x = F.relu(self.fc1(h[..., :64]))
        x = torch.cat([x, x], -1)[..., 64:192]  # a window of a wider activation
        return self.fc3(F.relu(self.fc2(x)))


def _close(out, expected, what=""):
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.05, msg=what or None)


def _grads_close(grads, expected, what):
    for name, grad in grads.items():  # the same math summed in other orders, in bf16
        ref = expected[name]
        assert (grad.float() - ref.float()).norm() <= 0.05 * ref.float().norm() + 1e-2, f"{what} {name}"


# ---- training


def _train(spec, kernel, *, capability=(9, 0), dynamic=False, autocast=False, tokens=(64,) * STEPS):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Sliced()
    if not autocast:
        model = model.to(BF16)
    nmcompile.annotate(model, spec)
    compiled = torch.compile(model, backend="nmsparse", dynamic=dynamic, options={**AOT, "train_kernel": kernel})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # STEP needs Adam's second moment
    outputs, grads, counts = [], [], []
    with emulated_gpu(capability=capability) as emu:
        for step, count in enumerate(tokens):
            torch.manual_seed(step)
            h = torch.randn(count // 8, 8, 96, dtype=torch.float32 if autocast else BF16)
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                out = compiled(h)
            out.float().square().mean().backward()
            outputs.append(out.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            counts.append(sum(c.op in SPARSE_CALLS for c in emu.calls))
            opt.step()
            opt.zero_grad()
    return model, outputs, grads, counts


def _check_training(name, kernel, **kw):
    spec = SPECS[name]
    tokens = kw.get("tokens", (64,) * STEPS)  # sparse kernels at every step of the first step's count
    # the dense reference is compared at step 0 only: one step, compiled static (the same math and the same
    # random draws as a dynamic graph, without tracing MVUE's symbolic shapes once more)
    _, dense_out, dense_grads, _ = _train(spec, "dense", **{**kw, "dynamic": False, "tokens": tokens[:1]})
    model, out, grads, counts = _train(spec, kernel, **kw)
    report = train_report(model)
    if name not in ("mdgf", "sdgf"):  # MDGF's alpha-scaled weights are not N:M; SDGF's are from its last frame
        assert report["fc2.weight"].forward.sparse, report
    assert counts[0] > 0 and all(counts[i] > counts[i - 1] for i in range(1, STEPS) if tokens[i] == tokens[0]), counts
    _close(out[0], dense_out[0], f"{name} step 0 output")
    _grads_close(grads[0], dense_grads[0], f"{name} step 0 gradient")
    for step in range(1, STEPS):  # masks may flip on rounding afterwards: the same scale, finite
        assert torch.isfinite(out[step].float()).all()
    return report


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_every_recipe_trains_on_emulated_cusparselt_as_dense_does(name):
    report = _check_training(name, "cusparselt")
    if name == "transposable":
        assert report["fc2.weight"].dgrad.kernel == report["fc2.weight"].wgrad.kernel == "cusparselt"


@pytest.mark.parametrize("name", sorted(set(SPECS) - set(TRAINED)))
def test_one_shot_recipes_calibrate_on_the_dense_kernel_and_say_why(name):
    _, dense_out, _, _ = _train(SPECS[name], "dense", tokens=(64,))  # compared at step 0 only
    model, out, grads, counts = _train(SPECS[name], "cusparselt")
    assert counts[-1] == 0  # no sparse call while the weights are dense and their statistics gather
    assert "not N:M by construction" in train_report(model)["fc2.weight"].forward.reason
    _close(out[0], dense_out[0], f"{name} step 0 output")
    assert int(model.fc2.weight_nm_count) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_every_recipe_trains_on_emulated_cutlass_with_dynamic_token_counts(name):
    # 64 tokens fit CUTLASS's WGRAD reduction dim (by 64); 48 take the dense WGRAD at run time
    report = _check_training(name, "cutlass", capability=(8, 0), dynamic=True, tokens=(64, 48, 64))
    assert report["fc2.weight"].forward.kernel in ("cutlass", "dense")


@pytest.mark.slow
def test_auto_under_autocast_picks_the_kernels_and_trains_as_dense_does():
    report = _check_training("transposable", "auto", autocast=True)
    assert {report["fc2.weight"].forward.kernel, report["fc2.weight"].dgrad.kernel} == {"cusparselt"}
    assert report["fc2.weight"].forward.speedup == 2.0  # the emulator's timer: sparse twice as fast


def test_static_tokens_off_the_multiple_of_8_train_dense_and_say_why():
    model = Sliced().to(BF16)
    nmcompile.annotate(model, "transposable:2:4,wgrad=mvue24")
    compiled = torch.compile(model, backend="nmsparse", options={**AOT, "train_kernel": "auto"})
    with emulated_gpu() as emu:
        compiled(torch.randn(6, 10, 96, dtype=BF16)).float().sum().backward()  # 60 tokens
    kernels = train_report(model)["fc2.weight"]
    assert not kernels.sparse and not [c for c in emu.calls if c.op in SPARSE_CALLS]
    assert "x [128, 60]: its other operand's dim (60) is not a multiple of 8" in kernels.forward.reason
    assert "reduction dim (60) is not a multiple of 16" in kernels.wgrad.reason


# ---- deploy


def _finalized(spec, dtype=BF16):
    torch.manual_seed(0)
    model = Sliced()
    nmcompile.annotate(model, spec)
    if nmcompile.recipes.parse(spec).calibrated:  # one-shot: statistics from calibration batches, then solved
        compiled = torch.compile(model, backend="nmsparse", options=AOT)

        def calibrate():
            with torch.no_grad():
                for _ in range(2):
                    compiled(torch.randn(8, 8, 96))

        nmcompile.finalize(model, calibration=calibrate)
        torch._dynamo.reset()
    else:
        nmcompile.finalize(model, force=True)
    return model.to(dtype).eval()


def _deploy(model, inputs, *, dynamic=False, autocast=False, faster_from=0, inner="aot_eager", **options):
    torch._dynamo.reset()
    with emulated_gpu(faster_from=faster_from) as emu, torch.no_grad():
        compiled = torch.compile(model, backend="nmsparse", dynamic=dynamic, options={"inner": inner, **options})
        for h in inputs:
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                out, expected = compiled(h), model(h)
            assert out.dtype == expected.dtype
            _close(out, expected, f"{tuple(h.shape)}")
    return nmcompile.deploy_report(model), emu


@pytest.mark.parametrize("name", list(SPECS))
def test_every_recipe_deploys_on_emulated_cusparselt_at_a_static_count_off_the_multiple_of_8(name):
    model = _finalized(SPECS[name])
    report, emu = _deploy(model, [torch.randn(197, 96, dtype=BF16)])  # ViT's 197 tokens
    assert {d.kernel for d in report.values()} == {"cusparselt"}, report
    runs = [c for c in emu.calls if c.op == "cslt_sparse_mm"]
    assert {c.dims[2] for c in runs} == {200} and len(runs) >= 2 * len(report)  # timed, then run, padded


def test_sliced_inputs_deploy_right_at_a_multiple_of_8():
    # 32 tokens need no padding: fc1 reads h[..., :64] and fc2 a window of a wider activation, as views
    model = _finalized(SPECS["ste"])
    report, emu = _deploy(model, [torch.randn(4, 8, 96, dtype=BF16)])
    assert {d.kernel for d in report.values()} == {"cusparselt"}
    assert {c.dims[2] for c in emu.calls if c.op == "cslt_sparse_mm"} == {32}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
def test_every_recipe_deploys_with_a_dynamic_token_count(name):
    model = _finalized(SPECS[name])
    report, emu = _deploy(model, [torch.randn(b, 96, dtype=BF16) for b in (3, 8, 65)], dynamic=True, faster_from=64)
    for decision in report.values():
        assert decision.kernel == "cusparselt" and decision.min_tokens == 64, decision
    ran = [c.dims[2] for c in emu.calls if c.op == "cslt_sparse_mm"]
    assert 72 in ran  # 65 tokens: past min_tokens, padded


def test_deploy_under_autocast_with_a_dynamic_count():
    model = _finalized(SPECS["transposable"])  # bf16 weights, float32 inputs under a bf16 autocast
    report, emu = _deploy(model, [torch.randn(b, 96) for b in (5, 16)], dynamic=True, autocast=True)
    assert {d.kernel for d in report.values()} == {"cusparselt"}
    assert {c.dtypes for c in emu.calls if c.op == "cslt_sparse_mm"} == {(BF16, BF16)}


@pytest.mark.slow
def test_cuda_graphs_time_the_kernels_by_gpu_time_and_say_so():
    # cuSPARSELt plans on the host at every call (about 0.4 ms, measured on an H100/H200): outside CUDA
    # graphs that host work counts, under mode="reduce-overhead" only the GPU's time does
    model = _finalized(SPECS["ste"])
    report, emu = _deploy(model, [torch.randn(32, 96, dtype=BF16)], inner="inductor", mode="reduce-overhead")
    assert emu.graph_timings and all(emu.graph_timings)
    assert all(d.kernel == "cusparselt" and "GPU time under CUDA graphs" in d.reason for d in report.values()), report
    report, emu = _deploy(model, [torch.randn(32, 96, dtype=BF16)])
    assert emu.graph_timings and not any(emu.graph_timings)
    assert all("host work included" in d.reason for d in report.values()), report


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_hands_the_op_its_traced_strides_and_the_result_is_right():
    model = _finalized(SPECS["sr_ste"])
    report, emu = _deploy(model, [torch.randn(4, 6, 96, dtype=BF16)], inner="inductor")
    assert {d.kernel for d in report.values()} == {"cusparselt"}
    assert any(c.op == "cslt_sparse_mm" and c.dims[2] == 24 for c in emu.calls)
