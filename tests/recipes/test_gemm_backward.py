"""Recipes that change a GEMM's backward: MVUE weight gradients, FP8 simulation, Bi-Mask's DGRAD mask."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile
from nmcompile import recipes
from nmcompile.masks import mvue
from nmcompile.backends.nmsparse import _copy
from nmcompile.passes import TRAIN_PASSES, PassContext, run_passes

import reference


def linear_layer(out=16, inp=32, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(inp, out)


def grads(model, compiled, x, dy, seed=None):
    x = x.clone().requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    out = compiled(x)
    out.backward(dy)
    result = x.grad, model.weight.grad.clone(), model.bias.grad.clone(), out.detach()
    model.zero_grad()
    return result


@pytest.mark.parametrize("wgrad, pattern", [("mvue24", (2, 4)), ("mvue12", (1, 2))])
def test_mvue_weight_gradient_is_exactly_the_sampled_estimator(wgrad, pattern):
    layer = linear_layer()
    nmcompile.annotate(layer, recipes.STE(wgrad=wgrad))
    compiled = torch.compile(layer, backend="nmsparse", options={"inner": "aot_eager"})
    x, dy = torch.randn(2, 10, 32), torch.randn(2, 10, 16)  # 20 tokens
    w_eff = layer.weight * reference.topn_mask(layer.weight, 2, 4)
    dx, dw, db, out = grads(layer, compiled, x, dy, seed=7)
    torch.testing.assert_close(out, F.linear(x, w_eff, layer.bias))
    torch.testing.assert_close(dx, dy @ w_eff)  # DGRAD keeps the exact output gradient
    torch.testing.assert_close(db, dy.sum((0, 1)))  # and so does the bias
    torch.manual_seed(7)
    g = dy.reshape(20, 16)
    g_pad = F.pad(g, (0, 0, 0, (-20) % pattern[1]))
    sampled = mvue(g_pad, *pattern, dim=0)[:20]  # the same uniforms: the backward's only draw after the seed
    torch.testing.assert_close(dw, sampled.T @ x.reshape(20, 32))
    groups = sampled.T.unflatten(1, (-1, pattern[1]))
    assert int((groups != 0).sum(-1).max()) <= pattern[0]


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_mvue_weight_gradient_is_unbiased_under_inductor(kind):
    torch.manual_seed(0)
    if kind == "linear":
        layer, x = nn.Linear(16, 8), torch.randn(64, 16)
    else:
        layer, x = nn.Conv2d(8, 8, 3, padding=1), torch.randn(2, 8, 6, 6)
    nmcompile.annotate(layer, recipes.STE(wgrad="mvue24"))
    compiled = torch.compile(layer, backend="nmsparse")
    dy = torch.randn_like(compiled(x))
    dense = torch.compile(lambda x, w, b: (F.linear if kind == "linear" else F.conv2d)(x, w, b, **({} if kind == "linear" else {"padding": 1})))
    w_eff = nmcompile.effective_weights(layer)["weight"].requires_grad_()
    xr = x.clone().requires_grad_()
    dense(xr, w_eff, layer.bias.detach()).backward(dy)
    draws = []
    for _ in range(300):
        dx, dw, _, _ = grads(layer, compiled, x, dy)
        torch.testing.assert_close(dx, xr.grad, rtol=1e-4, atol=1e-5)
        draws.append(dw)
    draws = torch.stack(draws)
    assert not torch.allclose(draws[0], draws[1])  # really sampled
    stderr = draws.std(0) / len(draws) ** 0.5
    z = (draws.mean(0) - w_eff.grad).abs() / stderr.clamp_min(1e-6)
    assert float(z.max()) < 5.5, f"mean of the sampled weight gradients is off by {float(z.max()):.1f} standard errors"


def test_fp8_simulation_matches_its_equations():
    layer = linear_layer()
    recipe = recipes.SSTE(fp8=True)
    nmcompile.annotate(layer, recipe)
    compiled = torch.compile(layer, backend="nmsparse", options={"inner": "aot_eager"})
    x, dy = torch.randn(12, 32), torch.randn(12, 16)
    dx, dw, db, out = grads(layer, compiled, x, dy)
    w_hat = nmcompile.effective_weights(layer)["weight"]
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    expected = reference.fake_fp8(x, e4) @ reference.fake_fp8(w_hat, e4).T + layer.bias
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, F.linear(x, w_hat, layer.bias), atol=1e-4)  # rounding happened
    torch.testing.assert_close(dx, reference.fake_fp8(dy, e5) @ reference.fake_fp8(w_hat, e5))
    torch.testing.assert_close(dw, reference.fake_fp8(dy, e5).T @ reference.fake_fp8(x, e5))
    torch.testing.assert_close(db, dy.sum(0))


@pytest.mark.slow
def test_fp8_with_mvue_is_the_full_s_ste_recipe_and_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    nmcompile.annotate(model, "s_ste:2:4,wgrad=mvue24,fp8=true")
    compiled = torch.compile(model, backend="nmsparse")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(128, 32)
    y = x[:, :8] * 2
    losses = []
    for _ in range(60):
        loss = F.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert nmcompile.check(model).ok


class InOutLinear(nn.Module):
    """A GPT-2 ``Conv1D``-style layer: weight ``[in, out]``, ``addmm``; N:M groups along dim 0."""

    def __init__(self, inp, out):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(inp, out) / inp**0.5), nn.Parameter(torch.randn(out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


BI_MASK_LAYERS = {  # layer, input, reference op, and how to view the weight as [out, in, ...]
    "linear": (lambda: nn.Linear(32, 16), (4, 32), F.linear, lambda w: w),
    "conv": (lambda: nn.Conv2d(8, 8, 3, padding=1), (2, 8, 5, 5), lambda x, w, b: F.conv2d(x, w, b, padding=1), lambda w: w),
    "in_out": (lambda: InOutLinear(32, 16), (4, 32), lambda x, w, b: torch.addmm(b, x, w), lambda w: w.t()),
}


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("layout", list(BI_MASK_LAYERS))
def test_bi_mask_gradients_use_exactly_their_masks(layout, inner):
    make, x_shape, op, out_in = BI_MASK_LAYERS[layout]
    torch.manual_seed(0)
    layer = make()
    recipe = "bi_mask:2:4,decay=0.01,candidates=20"
    if layout != "in_out":  # annotate knows these layers; the backend finds the [in, out] weight's axes
        nmcompile.annotate(layer, recipe)
    options = {"inner": inner, **({"recipe": recipe} if layout == "in_out" else {})}
    compiled = torch.compile(layer, backend="nmsparse", options=options)
    x = torch.randn(x_shape)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "nmsparse: recipe state")  # (made at the first forward)
        out = compiled(x)
    perm = layer.weight_nm_perm
    assert sorted(perm.tolist()) == list(range(out_in(layer.weight).shape[0]))
    with torch.no_grad():  # the search may keep the identity on so small a layer: set an order that is not
        perm.copy_(torch.randperm(perm.numel(), generator=torch.Generator().manual_seed(1)))
    assert not torch.equal(perm, torch.arange(perm.numel()))
    dy = torch.randn_like(out)
    dx, dw, db, out = grads(layer, compiled, x, dy)
    w = out_in(layer.weight.detach())
    f = out_in(reference.topn_mask(w, 2, 4, 1))
    b = out_in(reference.bi_mask_backward_mask(w, perm, 2, 4))
    w = out_in(w)  # back to the stored layout
    assert not torch.equal(b, f)
    torch.testing.assert_close(out, op(x, w * f, layer.bias))
    xr = x.clone().requires_grad_()
    op(xr, w * b, layer.bias).backward(dy)
    torch.testing.assert_close(dx, xr.grad)  # DGRAD with the backward mask, exactly
    wr = (w * f).requires_grad_()
    op(x, wr, layer.bias).backward(dy)
    torch.testing.assert_close(dw, wr.grad + 0.01 * (~f) * w)  # dense WGRAD + lambda (1 - F) W
    # B keeps at most N of M along the output axis, in permuted order, and only weights F keeps
    b_perm = out_in(b).flatten(1)[perm]
    assert int(b_perm.unflatten(0, (-1, 4)).sum(1).max()) <= 2
    assert not (b & ~f).any()


def rewritten(model, x, grad=True):
    """Dynamo's graph of ``model(x)`` after the training passes, and their context."""
    done = []

    def capture(gm, example_inputs):  # the passes read Dynamo's example values, which live only here
        work = _copy(gm)  # as the backend does: Dynamo's own graph must not change
        done.append((work, run_passes(work, TRAIN_PASSES, PassContext())))
        return gm.forward

    with torch.set_grad_enabled(grad):
        torch.compile(model, backend=capture)(x)
    (result,) = done
    return result


def test_bi_mask_dgrad_weight_is_a_forward_output_only_where_an_input_gradient_needs_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    nmcompile.annotate(model, "bi_mask:2:4,candidates=4")
    x, xg = torch.randn(4, 32), torch.randn(4, 32, requires_grad=True)
    for inp, grad, layers in [(x, True, ["2", "4"]), (xg, True, ["0", "2", "4"]), (x, False, [])]:
        torch.compiler.reset()
        gm, ctx = rewritten(model, inp, grad)
        (outputs,) = next(iter(gm.graph.find_nodes(op="output"))).args
        # the first layer's W * B is needed only when the model's input needs a gradient
        expected = [ctx.projected[f"{layer}.weight"][1] for layer in layers]
        assert ctx.extra_outputs == len(layers) and list(outputs[1:]) == expected
        assert all(node.target is torch.ops.nmsparse.backward_mask_weight for node in expected)


def test_bi_mask_permutation_search_and_schedule():
    torch.manual_seed(0)
    w = torch.randn(32, 16)
    from nmcompile.recipes.bi_mask import search_permutation, shared_kept

    perm = search_permutation(w, 2, 4, 1, candidates=50, step=0)
    # the candidates depend on the step only: no draw from the user's generator, same on every rank
    state = torch.get_rng_state()
    assert torch.equal(search_permutation(w, 2, 4, 1, candidates=50, step=0), perm)
    assert torch.equal(torch.get_rng_state(), state)
    identity = torch.arange(32)
    scores = shared_kept(w, torch.stack([identity, perm]), 2, 4, 1)
    assert scores[1] >= scores[0]
    b = reference.bi_mask_backward_mask(w, perm, 2, 4)
    assert int(b.sum()) == int(scores[1])  # the score is the number of weights both masks keep

    layer = nn.Linear(16, 32)
    nmcompile.annotate(layer, recipes.BiMask(every=3, candidates=5))
    compiled = torch.compile(layer, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    nmcompile.hook_optimizer(layer, opt)
    changed = []
    for step in range(1, 10):
        before = layer.weight_nm_perm.clone()
        compiled(torch.randn(8, 16)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        changed.append(not torch.equal(before, layer.weight_nm_perm))
    assert not any(c for i, c in enumerate(changed, 1) if i % 3)  # searched only every 3 steps
