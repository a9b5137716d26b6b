"""MDGF (mask decay) and SDGF (structure decay): forward weights per step, clocks, compiles per frame."""

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile import recipes

import reference


def mlp(width=64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 16))


def train(model, compiled, steps, accumulate=1, lr=1e-3):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    nmcompile.hook_optimizer(model, opt)
    for _ in range(steps):
        for _ in range(accumulate):
            compiled(torch.randn(8, model[0].in_features)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def aot_compiles():
    return torch._dynamo.utils.counters["aot_autograd"]["total"]


@pytest.mark.parametrize(
    "recipe",
    [
        recipes.MDGF(decay_coef=0.1),
        recipes.MDGF(n=1, m=8, decay_coef=0.05, schedule="linear"),
        recipes.MDGF(decay_coef=0.2, dense_fraction=0.2, finetune_fraction=0.3, total_steps=20),
    ],
    ids=str,
)
def test_mdgf_forward_follows_alpha_t_without_recompiling(recipe):
    model = mlp()
    nmcompile.annotate(model, recipe)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    nmcompile.hook_optimizer(model, opt)
    before = aot_compiles()
    x = torch.randn(8, 64)
    for step in range(20):
        alpha = reference.mdgf_alpha(step, recipe.decay_coef, recipe.schedule, recipe.dense_steps, recipe.finetune_start)
        w = model[0].weight
        expected = reference.mdgf_weight(w, recipe.n, recipe.m, alpha)
        torch.testing.assert_close(nmcompile.effective_weights(model)["0.weight"], expected)
        out = compiled(x)
        ref_out = torch.func.functional_call(
            model, {"0.weight": expected, "2.weight": reference.mdgf_weight(model[2].weight, recipe.n, recipe.m, alpha)}, (x,)
        )
        torch.testing.assert_close(out, ref_out)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert int(model[0].weight_nm_step) == 20
    assert aot_compiles() - before == 1, "alpha_t is a graph input: no recompiles"
    if recipe.finetune_start is not None:
        assert nmcompile.check(model).ok  # binary masks at the end


def test_mdgf_gradient_is_straight_through():
    recipe = recipes.MDGF(decay_coef=0.3)
    model = mlp()
    nmcompile.annotate(model, recipe)
    with torch.no_grad():
        model[0].weight_nm_step.fill_(4)
        model[2].weight_nm_step.fill_(4)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    x = torch.randn(8, 64)
    compiled(x).sum().backward()
    alpha = reference.mdgf_alpha(4, 0.3)
    w_eff = reference.mdgf_weight(model[0].weight.detach(), 2, 4, alpha).requires_grad_()
    h = torch.relu(x @ w_eff.T + model[0].bias)
    w2 = reference.mdgf_weight(model[2].weight.detach(), 2, 4, alpha)
    (h @ w2.T + model[2].bias).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, w_eff.grad)  # dL/dW_eff reaches W unchanged


def test_clock_counts_optimizer_steps_not_forwards():
    model = mlp()
    nmcompile.annotate(model, recipes.MDGF())
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    train(model, compiled, steps=3, accumulate=4)
    assert int(model[0].weight_nm_step) == 3


@pytest.mark.parametrize(
    "spec, frames",
    [
        ("sdgf:1:8,total_steps=100", [(7, 8), (4, 8), (2, 8), (1, 8)]),
        ("sdgf:1:16,total_steps=100", [(15, 16), (8, 16), (4, 16), (2, 16), (1, 16)]),
        ("sdgf:1:8,total_steps=100,schedule=geometric", [(8, 64), (4, 32), (2, 16), (1, 8)]),
        ("sdgf:1:8,total_steps=100,schedule=densify", [(1, 64), (1, 32), (1, 16), (1, 8)]),
        ("sdgf:1:8,total_steps=100,schedule=4:8/2:8/1:8", [(4, 8), (2, 8), (1, 8)]),
    ],
)
def test_sdgf_schedules(spec, frames):
    recipe = nmcompile.recipe(spec)
    assert list(recipe.frames) == frames
    assert nmcompile.recipe(str(recipe)) == recipe
    span = 100 / len(frames)
    assert [recipe.frame_at(int(i * span)) for i in range(len(frames))] == list(range(len(frames)))
    assert recipe.frame_at(99) == len(frames) - 1


def test_sdgf_trains_through_frames_with_one_compile_each():
    recipe = recipes.SDGF(n=1, m=8, total_steps=12, dense_fraction=0.25)  # 3 dense steps, 4 frames of 2.25
    model = mlp()
    nmcompile.annotate(model, recipe)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    nmcompile.hook_optimizer(model, opt)
    before = aot_compiles()
    x = torch.randn(8, 64)
    seen = []
    for step in range(14):
        frame = recipe.frame_at(step)
        pattern = recipe.pattern_at(frame)
        w = model[0].weight
        expected = w if pattern is None else w * reference.topn_mask(w, *pattern, 1)
        torch.testing.assert_close(nmcompile.effective_weights(model)["0.weight"], expected)
        compiled(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        seen.append(frame)
    assert seen == [-1, -1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 3]  # frames start at 3 + int(i * 2.25)
    assert aot_compiles() - before == 5  # one graph per frame: dense and four N:M frames
    assert nmcompile.check(model).ok


def test_sdgf_rejects_bad_declarations():
    with pytest.raises(ValueError, match="total_steps"):
        nmcompile.recipe("sdgf:1:8")
    with pytest.raises(ValueError, match="must end at the recipe's pattern 1:8"):
        nmcompile.recipe("sdgf:1:8,total_steps=10,schedule=4:8/2:8")
    report = nmcompile.annotate(nn.Linear(32, 8), "sdgf:1:8,total_steps=10,schedule=geometric")
    assert "64" in report.skipped["weight"]  # the 8:64 frame needs in % 64 == 0


@pytest.mark.parametrize("route", ["annotate", "options"])
@pytest.mark.parametrize(
    "spec", ["mdgf:2:4", "sdgf:1:8,total_steps=100", "transposable:2:4,every=2", "step:2:4,total_steps=100"]
)
def test_first_call_under_inference_mode_then_training_counts_steps(spec, route):
    """State created on a first call under inference_mode must be ordinary tensors: training updates it."""
    model = mlp()
    x = torch.randn(8, 64)
    if route == "annotate":
        nmcompile.annotate(model, spec)
        compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    else:
        compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager", "recipe": spec})
    with torch.inference_mode():
        first = compiled(x)
    effective = nmcompile.effective_weights(model)
    assert set(effective) == {"0.weight", "2.weight"}
    h = torch.relu(x @ effective["0.weight"].T + model[0].bias)
    torch.testing.assert_close(first, h @ effective["2.weight"].T + model[2].bias)
    assert not any(b.is_inference() for b in model.buffers())
    train(model, compiled, steps=3)
    assert int(model[0].weight_nm_step) == 3 and int(model[2].weight_nm_step) == 3
    with torch.inference_mode():
        compiled(x)
    train(model, compiled, steps=1)
    assert int(model[0].weight_nm_step) == 4


def test_clock_reads_an_inference_step_and_refuses_to_count_on_it():
    from nmcompile.state.clock import StepMirror

    clock = StepMirror()
    with torch.inference_mode():
        step = torch.full((), 5, dtype=torch.int64)
        assert clock.read(step) == 5 and clock.advance(step) == 6  # inside inference_mode it can count
    assert clock.read(step) == 6
    with pytest.raises(RuntimeError, match="inference tensor.*outside inference_mode"):
        clock.advance(step)
