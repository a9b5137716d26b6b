"""Models that change under an annotation: checkpoints of other recipes or patterns, frozen, deleted
and shared layers, dtype and device moves. Each gets a named error or a documented handling, and
nothing is lost."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import nmcompile
from nmcompile.masks import count_violations


class MLP(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _steps(model, compiled, opt, n=2):
    g = torch.Generator().manual_seed(3)
    for _ in range(n):
        loss = compiled(torch.randn(8, 16, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss


def _train(model, n=2, recipe_hook=True, params=None):
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.Adam(model.parameters() if params is None else params, lr=1e-2)
    if recipe_hook:
        nmcompile.hook_optimizer(model, opt)
    return compiled, opt, _steps(model, compiled, opt, n)


def test_dense_checkpoint_into_annotated_model_computes_state_from_loaded_weights():
    model, pretrained = MLP(0), MLP(1)
    nmcompile.annotate(model, "s_ste:2:4", include=["fc1", "fc2"])
    dense = pretrained.state_dict()
    keys = set(dense)
    with pytest.warns(UserWarning, match=r"no s_ste:2:4 state for fc1\.weight \(fc1\.weight_nm_beta\).*loaded weight"):
        model.load_state_dict(dense)
    assert set(dense) == keys  # the caller's dict is left as it was
    nmcompile.annotate(pretrained, "s_ste:2:4", include=["fc1", "fc2"])  # annotate after loading: the same beta
    assert torch.equal(model.fc1.weight_nm_beta, pretrained.fc1.weight_nm_beta)
    assert torch.equal(model.fc2.weight_nm_beta, pretrained.fc2.weight_nm_beta)


def test_checkpoint_of_another_recipe_is_a_named_error_or_dropped_with_strict_false():
    source = MLP(1)
    nmcompile.annotate(source, "transposable:2:4", include=["fc2"])
    target = MLP(0)
    nmcompile.annotate(target, "s_ste:2:4", include=["fc2"])
    before = {k: v.clone() for k, v in target.state_dict().items()}
    named = r"fc2\.weight carries s_ste:2:4 \(state: fc2\.weight_nm_beta\).*holds .*fc2\.weight_nm_mask.*another recipe"
    with pytest.warns(UserWarning, match=named), pytest.raises(RuntimeError, match=r"Unexpected key.*fc2\.weight_nm_mask"):
        target.load_state_dict(source.state_dict())
    with pytest.warns(UserWarning, match="computed from the loaded weight"):
        result = target.load_state_dict(source.state_dict(), strict=False)
    assert sorted(result.unexpected_keys) == ["fc2.weight_nm_mask", "fc2.weight_nm_step"]
    assert torch.equal(target.fc2.weight, source.fc2.weight)
    assert not torch.equal(target.fc2.weight_nm_beta, before["fc2.weight_nm_beta"])  # recomputed, not stale


def test_mask_saved_with_another_pattern_is_a_named_error():
    source, target = MLP(1), MLP(0)
    nmcompile.annotate(source, "asp:2:4,permute=False", include=["fc2"])
    nmcompile.annotate(target, "asp:1:4,permute=False", include=["fc2"])
    before = target.state_dict()
    with pytest.raises(RuntimeError, match=r"fc2\.weight_nm_mask in the checkpoint is not 1:4 .*asp:1:4"):
        target.load_state_dict(source.state_dict())
    assert count_violations(target.fc2.weight_nm_mask, 1, 4, 1)[0] == 0  # the target's valid mask is kept
    assert torch.equal(target.fc2.weight_nm_mask, before["fc2.weight_nm_mask"])


@pytest.mark.parametrize("spec", ["asp:2:4,permute=False", "transposable:2:4,every=1"])
def test_a_mask_with_values_other_than_0_and_1_is_refused_at_load_and_named_by_check(spec):
    model = MLP(0)
    nmcompile.annotate(model, spec, include=["fc2"])
    before = model.fc2.weight_nm_mask.clone()
    scaled = model.state_dict()
    scaled["fc2.weight_nm_mask"] = scaled["fc2.weight_nm_mask"].float() * 3.0  # kept weights would be 3x
    with pytest.raises(RuntimeError, match=r"fc2\.weight_nm_mask in the checkpoint holds values other than 0 and 1 "
                                           r"\(\d+ of them, e\.g\. 3\)"):
        model.load_state_dict(scaled)
    assert torch.equal(model.fc2.weight_nm_mask, before)  # the valid mask is kept
    with torch.no_grad():
        model.fc2.weight_nm_mask.mul_(3)  # written in place, past the load check
    report = nmcompile.check(model)
    assert not report.ok and "holds values other than 0 and 1" in report["fc2.weight"].problem


@pytest.mark.parametrize("spec", ["sr_ste:2:4", "transposable:2:4,every=1", "step:2:4,total_steps=4"])
def test_layer_frozen_after_annotation_keeps_its_mask_and_weights(spec):
    model = MLP()
    nmcompile.annotate(model, spec, exclude=["fc3"])
    model.fc1.weight.requires_grad_(False)
    frozen = model.fc1.weight.clone()
    compiled, opt, loss = _train(model, n=3)
    assert torch.isfinite(loss)
    assert torch.equal(model.fc1.weight, frozen)
    assert nmcompile.check(model).ok
    assert not torch.equal(model.fc2.weight, MLP().fc2.weight)  # the others train


def test_frozen_layer_left_out_of_the_optimizer_keeps_its_schedule_point():
    """Schedules run on the steps of the optimizer that updates the weight: a STEP layer the
    optimizer never sees stays in phase 1 (dense), and finalize names it."""
    model = MLP()
    nmcompile.annotate(model, "step:2:4,total_steps=4", exclude=["fc3"])
    model.fc1.weight.requires_grad_(False)
    _train(model, n=3, params=[p for p in model.parameters() if p.requires_grad])
    assert bool(model.fc2.weight_nm_phase) and not bool(model.fc1.weight_nm_phase)
    with pytest.raises(ValueError, match=r"fc1\.weight.*phase 1"):
        nmcompile.finalize(model)


def test_layer_deleted_after_annotation():
    model = MLP()
    nmcompile.annotate(model, "s_ste:2:4", exclude=["fc3"])
    compiled, opt, _ = _train(model, n=1, recipe_hook=False)
    model.fc2 = nn.Identity()  # the layer and its recipe state go together
    assert "fc2.weight_nm_beta" not in model.state_dict()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = _steps(model, compiled, opt, 2)  # Dynamo's guards see the new module and recompile
    assert torch.isfinite(loss)
    assert sorted(nmcompile.effective_weights(model)) == ["fc1.weight"]
    assert nmcompile.check(model).ok


def test_shared_layers():
    # one Parameter held by two different modules (tied): skipped, by name
    model = MLP()
    model.fc2b = nn.Linear(32, 32)
    model.fc2b.weight = model.fc2.weight
    report = nmcompile.annotate(model, "sr_ste:2:4")
    assert "shared by fc2.weight, fc2b.weight" in report.skipped["fc2.weight"]
    assert "fc2.weight" not in report.annotated

    # one module registered twice and called twice (shared before or after annotation): one layer,
    # annotated once under its first name; both calls use the N:M weight
    class Twice(MLP):
        def forward(self, x):
            h = F.relu(self.fc1(x))
            return self.fc3(F.relu(self.fc2(F.relu(self.fc2(h)))))

    model = Twice()
    nmcompile.annotate(model, "sr_ste:2:4", include=["fc2"])
    model.fc2_alias = model.fc2
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    w = nmcompile.effective_weights(model)["fc2.weight"]
    h = F.relu(model.fc1(x))
    want = model.fc3(F.relu(F.linear(F.relu(F.linear(h, w, model.fc2.bias)), w, model.fc2.bias)))
    torch.testing.assert_close(compiled(x), want)


@pytest.mark.parametrize("spec", ["s_ste:2:4", "transposable:2:4,every=1", "step:2:4,total_steps=4,t_max=0.25"])
def test_dtype_move_after_annotation(spec):
    model = MLP()
    nmcompile.annotate(model, spec, exclude=["fc3"])
    compiled, opt, _ = _train(model, n=2)
    step = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_nm_step")}
    model.double()  # parameters keep their objects (and recipes); float state follows, masks stay uint8
    assert all(torch.equal(model.state_dict()[k], v) for k, v in step.items())
    g = torch.Generator().manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "no recipe declared" fallback to dense
        loss = compiled(torch.randn(8, 16, generator=g, dtype=torch.float64)).square().mean()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # Adam's moments do not follow a dtype move
    nmcompile.hook_optimizer(model, opt)
    loss.backward()
    opt.step()
    assert loss.dtype == torch.float64 and torch.isfinite(loss)
    effective = nmcompile.effective_weights(model)
    assert sorted(effective) == ["fc1.weight", "fc2.weight"]
    assert all(w.dtype == torch.float64 for w in effective.values())
    assert nmcompile.check(model).ok


@pytest.mark.gpu
def test_device_move_after_annotation():
    model = MLP()
    nmcompile.annotate(model, "transposable:2:4,every=1", exclude=["fc3"])
    model.cuda()
    assert all(b.is_cuda for n, b in model.named_buffers() if "_nm_" in n)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    nmcompile.hook_optimizer(model, opt)
    loss = compiled(torch.randn(8, 16, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and nmcompile.check(model).ok


def test_non_finite_gradient_names_the_layer_and_the_step():
    model = MLP()
    nmcompile.annotate(model, "sr_ste:2:4", exclude=["fc3"])
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nmcompile.hook_optimizer(model, opt, check_finite=True)
    for step in range(1, 4):
        compiled(torch.randn(8, 16)).square().mean().backward()
        if step == 3:
            model.fc2.weight.grad[0, 0] = float("nan")
            before = {k: v.clone() for k, v in model.state_dict().items()}
            with pytest.raises(FloatingPointError, match=r"gradient of 'fc2\.weight' \(sr_ste:2:4\).*step 3"):
                opt.step()
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # step not taken
        else:
            opt.step()
        opt.zero_grad()


def test_non_finite_weights_keep_valid_masks_without_the_check():
    """Documented behaviour without check_finite: hard masks rank NaN above every finite value, so
    they stay N:M and the NaN reaches the loss, where it shows."""
    model = MLP()
    nmcompile.annotate(model, "ste:2:4", exclude=["fc3"])
    with torch.no_grad():
        model.fc1.weight[0, :4] = torch.tensor([float("nan"), 1.0, float("inf"), 0.5])
    assert nmcompile.check(model).ok
    w = nmcompile.effective_weights(model)["fc1.weight"]
    assert w[0, 1] == 0 and w[0, 3] == 0  # NaN and inf are kept, the finite ones pruned
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    assert not torch.isfinite(compiled(torch.randn(2, 16))).all()


class _Same(nn.Module):
    def forward(self, weight):
        return weight * 1.0


def test_a_parametrization_registered_after_annotate_is_named():
    model = MLP()
    nmcompile.annotate(model, "s_ste:2:4", exclude=["fc3"])
    parametrize.register_parametrization(model.fc1, "weight", _Same())
    named = r"fc1\.weight is declared s_ste:2:4, but a parametrization was registered on it afterwards.*remove_parametrizations"
    with pytest.raises(Exception, match=named):  # strict: an error (Dynamo wraps it in BackendCompilerFailed)
        torch.compile(model, backend="nmsparse", options={"inner": "aot_eager", "strict": True})(torch.randn(2, 16))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, n=2, recipe_hook=False)
    messages = [str(w.message) for w in caught]
    assert [m for m in messages if "left these weights dense" in m and "parametrization was registered" in m], messages
    assert not [m for m in messages if "no torch.compile" in m or "this optimizer step" in m]  # named once, by its cause
    with pytest.raises(ValueError, match=r"fc1\.weight is declared s_ste:2:4, but a parametrization"):
        nmcompile.check(model)
    eager = MLP()  # no graph: the step driver names it
    nmcompile.annotate(eager, "s_ste:2:4", include=["fc1"])
    parametrize.register_parametrization(eager.fc1, "weight", _Same())
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    eager(torch.randn(2, 16)).sum().backward()
    with pytest.warns(UserWarning, match=r"fc1\.weight is declared s_ste:2:4, but a parametrization.*this optimizer step"):
        opt.step()


@pytest.mark.parametrize("spec", ["s_ste:2:4", "asp:2:4,permute=False"])
def test_a_parameter_replaced_after_annotate_gets_state_from_its_new_values(spec):
    key = "fc1.weight_nm_" + ("beta" if spec.startswith("s_ste") else "mask")
    named = r"fc1\.weight was replaced by a new nn\.Parameter after it was declared.*computed again from the new weight"
    for route in ("effective_weights", "optimizer step", "compiled forward"):
        model, other = MLP(0), MLP(1)
        nmcompile.annotate(model, spec, include=["fc1"])
        model.fc1.weight = nn.Parameter(other.fc1.weight.detach().clone())
        nmcompile.annotate(other, spec, include=["fc1"])  # the new values, annotated as they are
        with pytest.warns(UserWarning, match=named):
            if route == "effective_weights":
                weights = nmcompile.effective_weights(model)
                torch.testing.assert_close(weights["fc1.weight"], nmcompile.effective_weights(other)["fc1.weight"])
            elif route == "optimizer step":  # eager: the step driver notices
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                model(torch.randn(2, 16)).sum().backward()
                opt.step()
            else:  # before the forward uses the state
                x = torch.randn(2, 16)
                out = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})(x)
        assert torch.equal(model.state_dict()[key], other.state_dict()[key]), route
        if route == "compiled forward":
            w = nmcompile.effective_weights(model)["fc1.weight"]
            torch.testing.assert_close(out, model.fc3(F.relu(model.fc2(F.relu(F.linear(x, w, model.fc1.bias))))))


def test_a_resized_parameter_after_annotate_is_named_with_the_fix():
    def resize(model):
        model.fc1.weight = nn.Parameter(torch.randn(64, 16) / 4)
        model.fc1.bias = nn.Parameter(torch.zeros(64))
        model.fc2.weight = nn.Parameter(torch.randn(32, 64) / 8)

    model = MLP()
    nmcompile.annotate(model, "transposable:2:4", include=["fc1"])
    resize(model)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    with pytest.raises(Exception, match=r"fc1\.weight was replaced by a new nn\.Parameter of shape \(64, 16\).*"
                                        r"nmcompile\.annotate\(model, 'transposable:2:4'\) again"):
        compiled(torch.randn(2, 16))
    nmcompile.annotate(model, "transposable:2:4", include=["fc1"])  # the named fix
    torch._dynamo.reset()
    assert model.fc1.weight_nm_mask.shape == (64, 16)
    assert torch.isfinite(compiled(torch.randn(2, 16))).all()
    model = MLP()  # state all from the weight's values: computed again, with a warning
    nmcompile.annotate(model, "asp:2:4,permute=False", include=["fc1"])
    resize(model)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"fc1\.weight was replaced.*computed again"):
        out = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})(torch.randn(2, 16))
    assert torch.isfinite(out).all() and model.fc1.weight_nm_mask.shape == (64, 16)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, idx):
        return self.head(self.emb(idx))


def _messages(model, inputs, steps=2, options=None):
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager", **(options or {})})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            compiled(inputs).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    return compiled, [str(w.message) for w in caught]


def test_weights_tied_after_annotate():
    model = Pair()
    nmcompile.annotate(model, "sr_ste:2:4")
    model.b.weight = model.a.weight  # both uses keep the declared recipe: nothing is dense
    x = torch.randn(4, 16)
    compiled, messages = _messages(model, x)
    assert not [m for m in messages if "dense" in m], messages
    w = nmcompile.effective_weights(model)["a.weight"]
    torch.testing.assert_close(compiled(x), F.linear(F.relu(F.linear(x, w, model.a.bias)), w, model.b.bias))

    model = Pair()  # holders that declared different recipes: named, with both declarations
    nmcompile.annotate(model, {"a": "sr_ste:2:4", "b": "asp:2:4,permute=False"})
    model.b.weight = model.a.weight
    torch._dynamo.reset()
    _, messages = _messages(model, x)
    named = [m for m in messages if "left these weights dense" in m]
    assert named and "shared by a.weight, b.weight, which carry different declarations" in named[0], messages
    assert not [m for m in messages if "no torch.compile" in m], messages

    model = TinyLM()  # a head tied to the embedding: dense, named as tied to an embedding
    report = nmcompile.annotate(model, {"head": "sr_ste:2:4"})  # named: heads are dense by default
    assert list(report.annotated) == ["head.weight"]
    model.head.weight = model.emb.weight
    torch._dynamo.reset()
    _, messages = _messages(model, torch.randint(0, 32, (2, 5)))
    assert [m for m in messages if "tied to an embedding" in m], messages
    assert not [m for m in messages if "no torch.compile" in m], messages
    with pytest.raises(Exception, match="tied to an embedding"):
        torch._dynamo.reset()
        _messages(model, torch.randint(0, 32, (2, 5)), options={"strict": True})
