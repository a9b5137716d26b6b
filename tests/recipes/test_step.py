"""STEP against an eager trainer written from its equations: AutoSwitch, the frozen moment, resume."""

import copy
from collections import deque

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile import recipes

import reference

BETAS, EPS, LR, WD = (0.9, 0.9), 2e-5, 1e-2, 0.01


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def batches(count, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)) for _ in range(count)]


def reference_run(model, data, recipe, z_option=1, eps=EPS):
    """AdamW where, after AutoSwitch, the masked weights use STE and v frozen at the switch."""
    params = dict(model.named_parameters())
    masked = {name for name, p in params.items() if p.dim() == 2}
    m = {k: torch.zeros_like(p) for k, p in params.items()}
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    frozen, window, switch, means = {}, deque(maxlen=recipe.window), -1, []
    t_min, t_max = int(recipe.t_min * recipe.total_steps), int(recipe.t_max * recipe.total_steps)
    losses = []
    for t, (x, y) in enumerate(data, start=1):
        weights = {
            k: reference.STE.apply(p, recipe.n, recipe.m, 1) if (k in masked and switch >= 0) else p
            for k, p in params.items()
        }
        loss = ((torch.func.functional_call(model, weights, (x,)) - y) ** 2).mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        losses.append(loss.detach())
        with torch.no_grad():
            if switch < 0:
                changes = torch.cat([((1 - BETAS[1]) * (g**2 - v[k])).abs().flatten()
                                     for (k, g) in zip(params, grads) if k in masked])
                z = changes.mean() if z_option == 1 else torch.where(changes > 0, changes, eps).log().mean().exp()
                window.append(z)
                means.append(float(sum(window) / len(window)))
            for (k, p), g in zip(params.items(), grads):
                p.mul_(1 - LR * WD)
                m[k] = BETAS[0] * m[k] + (1 - BETAS[0]) * g
                v[k] = BETAS[1] * v[k] + (1 - BETAS[1]) * g**2
                live = v[k] / (1 - BETAS[1] ** t)
                # frozen where the switch had a second moment, live where it had none
                denom = (torch.where(frozen[k] > 0, frozen[k], live) if k in frozen else live).sqrt() + eps
                p.sub_(LR / (1 - BETAS[0] ** t) * m[k] / denom)
            if switch < 0 and (t >= t_max or (t > t_min and sum(window) / len(window) < eps)):
                switch = t
                frozen = {k: v[k] / (1 - BETAS[1] ** t) for k in masked}
    return losses, switch, frozen, means


def nm_run(model, data, recipe, inner="aot_eager", eps=EPS):
    nmcompile.annotate(model, recipe)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": inner})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=eps, weight_decay=WD)
    nmcompile.hook_optimizer(model, opt)
    losses = []
    for x, y in data:
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, opt


@pytest.mark.parametrize("z_option", [1, 2])
def test_matches_reference_through_the_switch(z_option):
    recipe = recipes.STEP(total_steps=40, t_min=0.1, t_max=0.9, beta2=BETAS[1], z_option=z_option)
    data = batches(40)
    model = mlp()
    ref_model = copy.deepcopy(model)
    ref_losses, ref_switch, frozen, _ = reference_run(ref_model, data, recipe, z_option)
    losses, opt = nm_run(model, data, recipe)
    switch = int(model[0].weight_nm_switch_step)
    assert switch == ref_switch
    t_min, t_max = recipe.switch_range
    assert t_min < switch < t_max, "AutoSwitch should fire on Z_t here, before t_max"
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, ref_model.get_parameter(name), rtol=1e-4, atol=1e-5, msg=name)
    for name in ("0.weight", "2.weight"):
        module = model.get_submodule(name.split(".")[0])
        torch.testing.assert_close(module.weight_nm_v, frozen[name], rtol=1e-5, atol=1e-10)
        assert int(opt.state[module.weight]["step"]) == 40
    diag = nmcompile.diagnostics(model)["0.weight"]
    assert diag["z"].numel() == switch and int(diag["switch_step"]) == switch


def test_switch_at_t_max_and_sparse_forward_after():
    recipe = recipes.STEP(total_steps=20, t_min=0.1, t_max=0.5, beta2=BETAS[1])
    model = mlp()
    data = batches(12)
    nmcompile.annotate(model, recipe)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS, eps=1e-30)  # Z never below 1e-30
    nmcompile.hook_optimizer(model, opt)
    x = data[0][0]
    for i, (xb, yb) in enumerate(data, start=1):
        ((compiled(xb) - yb) ** 2).mean().backward()
        frozen_before = model[0].weight_nm_v.clone()
        opt.step()
        opt.zero_grad()
        if i < 10:
            assert not bool(model[0].weight_nm_phase)
            torch.testing.assert_close(compiled(x), model(x))  # phase 1 is dense
        if i > 10:
            torch.testing.assert_close(model[0].weight_nm_v, frozen_before)  # frozen
    assert int(model[0].weight_nm_switch_step) == 10
    assert nmcompile.check(model).ok
    eff = nmcompile.effective_weights(model)["0.weight"]
    torch.testing.assert_close(eff, model[0].weight * reference.topn_mask(model[0].weight, 2, 4))


def test_resume_from_state_dict_continues_identically():
    recipe = recipes.STEP(total_steps=30, t_min=0.1, t_max=0.4, beta2=BETAS[1])
    data = batches(24)
    model = mlp()
    full, _ = nm_run(model, data, recipe)
    torch._dynamo.reset()

    first = mlp()
    _, opt = nm_run(first, data[:8], recipe)
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict())
    torch._dynamo.reset()
    second = mlp()
    nmcompile.annotate(second, recipe)
    second.load_state_dict(saved_model)
    opt2 = torch.optim.AdamW(second.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt2.load_state_dict(saved_opt)
    nmcompile.hook_optimizer(second, opt2)
    compiled = torch.compile(second, backend="nmsparse", options={"inner": "aot_eager"})
    losses = []
    for x, y in data[8:]:
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        opt2.step()
        opt2.zero_grad()
        losses.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(full[8:]), rtol=1e-5, atol=1e-6)
    for name, p in second.named_parameters():
        torch.testing.assert_close(p, model.get_parameter(name), rtol=1e-5, atol=1e-6)
    assert int(second[0].weight_nm_switch_step) == int(model[0].weight_nm_switch_step) == 12


def test_needs_adam_and_matching_beta2():
    model = mlp()
    nmcompile.annotate(model, recipes.STEP(total_steps=10))
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    nmcompile.hook_optimizer(model, sgd)
    compiled(torch.randn(4, 16)).sum().backward()
    with pytest.raises(TypeError, match="needs torch.optim.Adam or AdamW.*SGD"):
        sgd.step()
    adam = torch.optim.Adam(model.parameters(), betas=(0.9, 0.95))
    nmcompile.hook_optimizer(model, adam)
    with pytest.raises(ValueError, match=r"beta2=0.95"):
        adam.step()


def test_a_checkpoint_saved_with_another_beta2_says_so_when_loaded():
    saved = mlp()
    nmcompile.annotate(saved, "step:2:4,total_steps=10,beta2=0.99")
    model = mlp()
    nmcompile.annotate(model, "step:2:4,total_steps=10")  # beta2=0.999: a window of 1000 samples, not 100
    with pytest.raises(RuntimeError, match=r"0.weight_nm_z in the checkpoint has shape \[100\], but step:2:4.* makes it "
                       r"\[1000\]: .*beta2 of about 0.99, .*saved with another beta2.*beta2=0.99\)") as info:
        model.load_state_dict(saved.state_dict())
    assert "size mismatch" not in str(info.value)
    same = mlp()
    nmcompile.annotate(same, "step:2:4,total_steps=10,beta2=0.99")
    same.load_state_dict(saved.state_dict())  # the same beta2 loads
    assert torch.equal(same[0].weight_nm_z, saved[0].weight_nm_z)


def test_schedules_count_optimizer_steps_without_hook_optimizer():
    model = mlp()
    nmcompile.annotate(model, recipes.STEP(total_steps=10))
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.Adam(model.parameters())
    for _ in range(3):
        compiled(torch.randn(4, 16)).sum().backward()
        opt.step()
    assert int(model[0].weight_nm_step) == 3
    nmcompile.hook_optimizer(model, opt)
    nmcompile.hook_optimizer(model, opt)  # twice: still one count per step
    compiled(torch.randn(4, 16)).sum().backward()
    opt.step()
    assert int(model[0].weight_nm_step) == 4


def test_a_weight_updated_outside_an_optimizer_step_is_an_error():
    model = mlp()
    nmcompile.annotate(model, recipes.STEP(total_steps=10))
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    compiled(torch.randn(4, 16)).sum().backward()
    with torch.no_grad():
        model[0].weight.sub_(0.1 * model[0].weight.grad)  # a hand-written update: no step is counted
    with pytest.raises(RuntimeError, match="without a torch.optim.Optimizer step"):
        compiled(torch.randn(4, 16))


def test_option_2_zero_changes_are_neutral():
    recipe = recipes.STEP(total_steps=40, t_min=0.05, t_max=0.9, beta2=BETAS[1], z_option=2)
    data = [(torch.cat([x[:, :8], torch.zeros(32, 8)], 1), y) for x, y in batches(10)]
    model = mlp()  # inputs 8..15 are always zero: those weight columns have |dv| = 0 exactly
    eps = 1e-7  # below the non-zero changes' geometric mean
    nm_run(model, data, recipe, eps=eps)
    z = nmcompile.diagnostics(model)["0.weight"]["z"]
    assert torch.isfinite(z).all() and (z > 0).all()
    assert int(model[0].weight_nm_switch_step) == -1  # without the floor, log 0 = -inf would switch at once
    ref_model = mlp()
    *_, means = reference_run(ref_model, data, recipe, z_option=2, eps=eps)
    assert min(means) >= eps


def closure_run(model, data, recipe):
    """``nm_run`` with the gradients computed in a closure: ``optimizer.step(closure)``."""
    nmcompile.annotate(model, recipe)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses, weights = [], []
    for x, y in data:
        def closure():
            opt.zero_grad()
            loss = ((compiled(x) - y) ** 2).mean()
            loss.backward()
            return loss
        losses.append(opt.step(closure).detach())
        weights.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return losses, weights


def test_step_with_a_closure_follows_the_plain_loop():
    """``opt.step(closure)`` computes the gradients inside the step: STEP's statistic and its
    frozen-moment update must read those, not the previous step's, before and after the switch."""
    recipe = recipes.STEP(total_steps=16, t_min=0.1, t_max=0.25, beta2=BETAS[1])  # switch by step 4
    data = batches(9)
    plain, with_closure = mlp(), mlp()
    plain_weights = []
    nmcompile.annotate(plain, recipe)
    compiled = torch.compile(plain, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    plain_losses = []
    for x, y in data:
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain_losses.append(loss.detach())
        plain_weights.append({name: p.detach().clone() for name, p in plain.named_parameters()})
    losses, weights = closure_run(with_closure, data, recipe)
    switch = int(plain[0].weight_nm_switch_step)
    assert 1 < switch <= 4 and int(with_closure[0].weight_nm_switch_step) == switch
    torch.testing.assert_close(with_closure[0].weight_nm_v, plain[0].weight_nm_v)
    torch.testing.assert_close(nmcompile.diagnostics(with_closure)["0.weight"]["z"],
                               nmcompile.diagnostics(plain)["0.weight"]["z"])
    torch.testing.assert_close(torch.stack(losses), torch.stack(plain_losses))
    for step, (got, want) in enumerate(zip(weights, plain_weights), start=1):  # phase 1, the switch, phase 2
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=f"{name} after step {step}")
