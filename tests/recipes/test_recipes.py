"""Each recipe, compiled through nmsparse, against an eager reference written from its equations."""

import copy

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile import recipes

import reference

RECIPES = ["ste:2:4", "sr_ste:2:4,decay=0.05", "s_ste:2:4"]


def mlp(width=16):
    return nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 8))


def _reference_step(model, recipe, x, y, betas):
    """One Adam step of the eager module-swap reference; returns (loss, grads)."""
    params = dict(model.named_parameters())
    weights = {
        name: reference.effective(recipe, p, 1, betas.get(name)) for name, p in params.items() if p.dim() == 2
    }
    out = torch.func.functional_call(model, {**params, **weights}, (x,))
    loss = ((out - y) ** 2).mean()
    loss.backward()
    return loss, {name: p.grad.clone() for name, p in params.items()}


@pytest.mark.parametrize(
    "options",
    [{"inner": "aot_eager"}, {"projections": "shared"}, {"projections": "inline"}],
    ids=["aot_eager", "inductor-shared", "inductor-inline"],
)
@pytest.mark.parametrize("spec", RECIPES)
def test_forward_gradient_and_adam_match_reference(spec, options):
    recipe = recipes.parse(spec)
    model = mlp()
    ref_model = copy.deepcopy(model)
    nmcompile.annotate(model, recipe)
    betas = {
        f"{name}.weight": getattr(mod, "weight_nm_beta", None) for name, mod in model.named_children()
    }
    if recipe.name == "s_ste":
        for name, b in betas.items():
            if b is not None:
                torch.testing.assert_close(b, reference.beta(ref_model.get_parameter(name), 2, 4))
    compiled = torch.compile(model, backend="nmsparse", options=options)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for _ in range(3):
        x, y = torch.randn(32, 16), torch.randn(32, 8)
        ref_loss, ref_grads = _reference_step(ref_model, recipe, x, y, betas)
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], msg=f"gradient of {name}")
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, ref_model.get_parameter(name), msg=f"{name} after Adam")
    effective = nmcompile.effective_weights(model)
    for name in ("0.weight", "2.weight"):
        w = model.get_parameter(name)
        expected = reference.effective(recipe, w.detach(), 1, betas.get(name))
        torch.testing.assert_close(effective[name], expected)
    assert nmcompile.check(model).ok


def test_sr_ste_gradient_is_dense_gradient_plus_decay_term():
    w = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(8, 16, dtype=torch.float64)
    out = recipes.SRSTE(decay=0.1).project(w, dim=1)
    out.backward(g)
    mask = reference.topn_mask(w.detach(), 2, 4, 1)
    torch.testing.assert_close(out, w.detach() * mask)
    torch.testing.assert_close(w.grad, g + 0.1 * (~mask) * w.detach())


def test_s_ste_gradient_is_straight_through_and_unscaled():
    w = torch.randn(8, 16, requires_grad=True)
    beta = torch.tensor(1.7)
    g = torch.randn(8, 16)
    out = recipes.SSTE().project(w, beta, dim=1)
    out.backward(g)
    torch.testing.assert_close(out, 1.7 * reference.soft_threshold(w.detach(), 2, 4, 1))
    torch.testing.assert_close(w.grad, g)


@pytest.mark.parametrize("pattern", ["1:2", "1:4", "2:8", "4:8", "1:8", "1:16", "1:32"])
@pytest.mark.parametrize("name", ["ste", "sr_ste", "s_ste"])
def test_any_n_m_trains_through_backend(name, pattern):
    recipe = recipes.parse(f"{name}:{pattern}")
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
    report = nmcompile.annotate(model, recipe)
    assert sorted(report.annotated) == ["0.weight", "2.weight"]
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    x = torch.randn(8, 64)
    out = compiled(x)
    out.sum().backward()
    eff = nmcompile.effective_weights(model)
    expected = torch.relu(x @ eff["0.weight"].T + model[0].bias) @ eff["2.weight"].T + model[2].bias
    torch.testing.assert_close(out, expected)
    n, m = recipe.n, recipe.m
    for w in eff.values():
        assert ((w != 0).unflatten(1, (-1, m)).sum(-1) <= n).all()


@pytest.mark.parametrize(
    "op,args",
    [
        (torch.ops.nmsparse.prune.default, lambda w: (w, 2, 4, 1)),
        (torch.ops.nmsparse.prune_decay.default, lambda w: (w, 2, 4, 1, 0.1)),
        (torch.ops.nmsparse.soft_threshold.default, lambda w: (w, torch.tensor(1.5), 2, 4, 1)),
        (torch.ops.nmsparse.prune_when.default, lambda w: (w, torch.tensor(True), 2, 4, 1, 0.1)),
        (torch.ops.nmsparse.prune_when.default, lambda w: (w, torch.tensor(False), 2, 4, 1, 0.0)),
    ],
)
def test_custom_ops_pass_opcheck(op, args):
    w = torch.randn(8, 16, requires_grad=True)
    torch.library.opcheck(op, args(w))
    conv = torch.randn(4, 8, 3, 3, requires_grad=True)
    a = list(args(conv))
    torch.library.opcheck(op, tuple(a))


def test_recipe_strings_round_trip():
    required = {"step": {"total_steps": 100}, "sdgf": {"total_steps": 100}}
    for name, cls in recipes.RECIPES.items():
        r = cls(n=1, m=8, **required.get(name, {}))
        assert recipes.parse(str(r)) == r
    assert recipes.parse("sr_ste:2:4,decay=2e-4") == recipes.SRSTE(decay=2e-4)
    assert nmcompile.recipe("s_ste:1:4") == recipes.SSTE(n=1, m=4)


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("spec", [
    "sr_ste:2:4,decay={}", "mdgf:2:4,decay_coef={}", "bi_mask:2:4,decay={}", "step:2:4,total_steps=100,decay={}",
    "step:2:4,total_steps=100,beta2={}", "mdgf:2:4,total_steps=100,dense_fraction={}",
])
def test_non_finite_hyperparameters_are_refused_naming_recipe_and_key(spec, bad):
    text = spec.format(bad)
    name, key = text.split(":")[0], text.rsplit(",", 1)[1].split("=")[0]
    with pytest.raises(ValueError, match=rf"^{name}: {key}={bad} is not a finite number"):
        nmcompile.recipe(text)
    with pytest.raises(ValueError, match="not a finite number"):  # the object route checks too
        recipes.get(name, **{key: float(bad)}, **({"total_steps": 100} if name == "step" else {}))


def test_recipe_string_refuses_pattern_keys_and_duplicate_keys():
    with pytest.raises(ValueError, match=r"n is not a key.*NAME:N:M, e\.g\. sr_ste:3:4"):
        nmcompile.recipe("sr_ste:2:4,n=3")
    with pytest.raises(ValueError, match=r"m is not a key.*e\.g\. sr_ste:2:8"):
        nmcompile.recipe("sr_ste,m=8")
    with pytest.raises(ValueError, match="decay is given twice"):
        nmcompile.recipe("sr_ste:2:4,decay=1e-4,decay=2e-4")
    assert nmcompile.recipe("sr_ste:3:4,decay=1e-4") == recipes.SRSTE(n=3, m=4, decay=1e-4)
