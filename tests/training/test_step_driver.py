"""The step driver at its edges: copies, foreign optimizers, shared weights, closures evaluated many times."""

import copy
import warnings

import pytest
import torch
from torch import nn

import nmcompile

AOT = {"inner": "aot_eager"}


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def test_an_eager_deepcopy_is_counted_and_named_like_its_original():
    model = mlp()
    nmcompile.annotate(model, "mdgf:2:4,decay_coef=0.5")
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(twin.parameters(), lr=1e-2)
    x, y = batch()
    ((twin(x) - y) ** 2).mean().backward()
    with pytest.warns(UserWarning, match=r"0\.weight.*declared but no.*trains them dense"):
        opt.step()
    assert int(twin[0].weight_nm_step) == 1 and int(twin[2].weight_nm_step) == 1
    assert int(model[0].weight_nm_step) == 0  # the original was not stepped


def test_a_copy_of_a_compiled_model_trained_eagerly_is_named():
    model = mlp()
    nmcompile.annotate(model, "sr_ste:2:4")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    x, y = batch()
    ((compiled(x) - y) ** 2).mean().backward()  # a graph has used the original's weights
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(twin.parameters(), lr=1e-2)
    ((twin(x) - y) ** 2).mean().backward()  # eager: the copy trains dense
    with pytest.warns(UserWarning, match=r"0\.weight.*declared but no.*trains them dense"):
        opt.step()
    # compiled, the copy is sparse-trained and nothing is named
    twin_compiled = torch.compile(twin, backend="nmsparse", options=AOT)
    opt.zero_grad()
    ((twin_compiled(x) - y) ** 2).mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_hook_optimizer_refuses_an_optimizer_of_another_model():
    model_a, model_b = mlp(0), mlp(1)
    nmcompile.annotate(model_a, "transposable:2:4,every=1")
    nmcompile.annotate(model_b, "transposable:2:4,every=1")
    opt_b = torch.optim.SGD(model_b.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"updates none of the model's annotated weights \(0\.weight, 2\.weight\)"):
        nmcompile.hook_optimizer(model_a, opt_b, check_finite=True)
    head_only = torch.optim.SGD([model_a[0].bias, model_a[2].bias], lr=1e-2)
    with pytest.raises(ValueError, match="updates none of the model's annotated weights"):
        nmcompile.hook_optimizer(model_a, head_only)
    plain = mlp(2)  # no record yet (the options route makes them at the first call): its parameters
    with pytest.raises(ValueError, match="updates none of the model's parameters"):
        nmcompile.hook_optimizer(plain, opt_b)
    nmcompile.hook_optimizer(model_b, opt_b, check_finite=True)  # its own optimizer: accepted


def test_one_weight_stepped_by_two_optimizers_in_one_iteration_is_refused():
    model = mlp()
    nmcompile.annotate(model, "transposable:2:4,every=1")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    opt_a = torch.optim.SGD(model.parameters(), lr=1e-2)
    opt_b = torch.optim.SGD(model[0].parameters(), lr=1e-2)
    x, y = batch()
    ((compiled(x) - y) ** 2).mean().backward()
    opt_a.step()
    with pytest.raises(ValueError, match=r"'0\.weight' .* updated by two optimizers, SGD and then SGD"):
        opt_b.step()
    assert int(model[0].weight_nm_step) == 1
    # one optimizer after the other, each with its own gradient: two steps, both counted
    opt_a.zero_grad()
    ((compiled(x) - y) ** 2).mean().backward()
    opt_b.step()
    assert int(model[0].weight_nm_step) == 2


def test_lbfgs_steps_a_compiled_model_with_a_schedule():
    """LBFGS evaluates its closure several times in one step, changing the weights in between: one
    optimizer step, counted once, not a weight updated without an optimizer step."""
    model = mlp()
    nmcompile.annotate(model, "transposable:2:4,every=1")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    x, y = batch()
    calls = []

    def closure():
        opt.zero_grad()
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        calls.append(float(loss.detach()))
        return loss

    for _ in range(2):
        opt.step(closure)
    assert len(calls) > 2 and calls[-1] < calls[0]
    assert int(model[0].weight_nm_step) == 2
    assert nmcompile.check(model).ok
    compiled(x)
    with torch.no_grad():  # a hand-written update outside any step is still named
        model[0].weight.sub_(0.1 * model[0].weight.grad)
    with pytest.raises(RuntimeError, match="without a torch.optim.Optimizer step"):
        compiled(x)


def test_check_finite_reads_the_gradient_a_closure_computes():
    model = mlp()
    nmcompile.annotate(model, "sr_ste:2:4")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    nmcompile.hook_optimizer(model, opt, check_finite=True)
    x, y = batch()
    x[0, 0] = float("inf")

    def closure():
        opt.zero_grad()
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        return loss

    before = model[0].weight.detach().clone()
    with pytest.raises(FloatingPointError, match=r"gradient of '0\.weight'.*at optimizer step 1"):
        opt.step(closure)
    assert torch.equal(model[0].weight, before)
