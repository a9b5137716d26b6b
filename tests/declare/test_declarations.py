"""Declarations hold whatever replaces parameter objects, schedules count steps with no call in the
user's code, and a declaration that leaves a weight dense says so."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile
from nmcompile import recipes
from nmcompile.declare.annotate import annotation_of

AOT = {"inner": "aot_eager"}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _train(model, compiled, steps, lr=1e-2, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = compiled(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return opt, losses


def test_meta_init_then_to_empty_computes_state_from_the_initialised_weights():
    with torch.device("meta"):
        model = MLP()
    nmcompile.annotate(model, "s_ste:2:4")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    twin = MLP()
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if "_nm_" not in k}, strict=False)
    nmcompile.annotate(twin, "s_ste:2:4")  # the same weights, annotated when real
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    x = torch.randn(4, 16)
    out = compiled(x)
    beta, expected = model.fc1.weight_nm_beta, twin.fc1.weight_nm_beta
    assert torch.isfinite(beta).all() and torch.equal(beta, expected)  # not from meta or empty memory
    torch.testing.assert_close(out, torch.compile(twin, backend="nmsparse", options=AOT)(x))
    assert set(nmcompile.effective_weights(model)) == {"fc1.weight", "fc2.weight", "fc3.weight"}


def test_meta_init_then_a_checkpoint_load_keeps_the_loaded_state():
    source = MLP()
    nmcompile.annotate(source, "s_ste:2:4")
    checkpoint = source.state_dict()
    for in_place in (False, True):
        with torch.device("meta"):
            model = MLP()
        nmcompile.annotate(model, "s_ste:2:4")
        model.to_empty(device="cpu")
        if in_place:  # as torch.distributed.checkpoint loads: into the tensors the state dict holds
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(checkpoint[k])
        else:
            model.load_state_dict(checkpoint)
        torch.compile(model, backend="nmsparse", options=AOT)(torch.randn(2, 16))
        assert torch.equal(model.fc1.weight_nm_beta, source.fc1.weight_nm_beta), in_place


EVERY_RECIPE = ["ste:2:4", "sr_ste:2:4", "s_ste:2:4", "step:2:4,total_steps=10", "mdgf:2:4", "sdgf:2:4,total_steps=10",
                "bi_mask:2:4", "transposable:2:4", "asp:2:4,permute=False"]


@pytest.mark.parametrize("spec", EVERY_RECIPE)
def test_meta_init_then_an_assign_load_of_a_dense_checkpoint_computes_state_from_it(spec):
    dense = MLP().state_dict()
    with torch.device("meta"):
        model = MLP()
    nmcompile.annotate(model, spec)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "nmcompile: the checkpoint has no")  # computed from the loaded weight
        model.load_state_dict(dense, assign=True)
    twin = MLP()
    twin.load_state_dict(dense)
    nmcompile.annotate(twin, spec)  # the same weights, annotated when real
    state, expected = model.state_dict(), twin.state_dict()
    assert not [k for k, v in state.items() if v.is_meta]
    assert set(state) == set(expected) and all(torch.equal(state[k], v) for k, v in expected.items())
    x = torch.randn(4, 16)
    out = torch.compile(model, backend="nmsparse", options=AOT)(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.compile(twin, backend="nmsparse", options=AOT)(x))


def test_meta_init_then_a_copy_load_leaves_the_state_pending_and_named():
    dense = MLP().state_dict()
    with torch.device("meta"):
        model = MLP()
    nmcompile.annotate(model, "transposable:2:4")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "for .*: copying from a non-meta parameter")  # PyTorch's: a no-op copy
        model.load_state_dict(dense)  # into meta tensors: nothing is loaded, nothing can be computed
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        nmcompile.effective_weights(model)


def test_a_meta_model_is_named_when_it_runs_before_initialisation():
    with torch.device("meta"):
        model = MLP()
    nmcompile.annotate(model, "s_ste:2:4")
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        nmcompile.effective_weights(model)
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        nmcompile.annotate(MLP().to("meta"), "asp:2:4")


@pytest.mark.parametrize("route", ["assign", "deepcopy", "pickle", "new parameter"])
def test_records_survive_whatever_replaces_the_parameters(route):
    model = MLP()
    nmcompile.annotate(model, "sr_ste:2:4", exclude=["fc3"])
    if route == "assign":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    elif route == "deepcopy":
        model = copy.deepcopy(model)
    elif route == "pickle":
        model = pickle.loads(pickle.dumps(model))
    else:
        model.fc1.weight = nn.Parameter(model.fc1.weight.detach().clone())
    assert annotation_of(model.fc1, "weight").recipe == recipes.SRSTE()
    assert annotation_of(model.fc3, "weight") is None
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    out = compiled(torch.randn(3, 16))
    assert out.shape == (3, 8)
    assert sorted(nmcompile.effective_weights(model)) == ["fc1.weight", "fc2.weight"]
    assert nmcompile.check(model).ok


def test_annotate_through_the_compiled_wrapper_uses_the_models_names():
    model = MLP()
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    report = nmcompile.annotate(compiled, "sr_ste:2:4", exclude=["fc3"])
    assert sorted(report.annotated) == ["fc1.weight", "fc2.weight"]
    assert "fc3.weight" in report.skipped
    compiled(torch.randn(2, 16))
    assert sorted(nmcompile.effective_weights(compiled)) == ["fc1.weight", "fc2.weight"]


@pytest.mark.parametrize("spec", ["step:2:4,total_steps=8,t_min=0.25,t_max=0.5", "mdgf:2:4,decay_coef=0.5",
                                  "sdgf:1:8,total_steps=6", "transposable:2:4,every=2", "bi_mask:2:4,every=2,candidates=4"])
def test_env_route_counts_optimizer_steps_with_no_nmcompile_call(spec, monkeypatch):
    """A plain loop, the recipe only in NMSPARSE_RECIPE: the schedule runs on optimizer steps."""
    monkeypatch.setenv("NMSPARSE_RECIPE", spec)
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # state made at the first forward (named by its own warning)
        _train(model, compiled, 5)
    assert int(model.fc1.weight_nm_step) == 5


def test_gradient_accumulation_and_skipped_steps_count_as_the_optimizer_does():
    model = MLP()
    nmcompile.annotate(model, "mdgf:2:4,decay_coef=0.5")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for step in range(3):
        for _ in range(4):  # four micro-batches per optimizer step
            scaler.scale(compiled(torch.randn(8, 16)).pow(2).mean()).backward()
        if step == 1:
            model.fc1.weight.grad[0, 0] = float("inf")  # the scaler skips this step
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert int(model.fc1.weight_nm_step) == 2


def test_schedules_stop_counting_when_nothing_needs_them(monkeypatch):
    import gc

    from torch.optim.optimizer import _global_optimizer_post_hooks

    from nmcompile.training import step_driver

    torch._dynamo.reset()
    gc.collect()  # earlier tests' models that only a collection frees would drop their hooks during this one
    # a driver that earlier tests' leftovers still hold (Dynamo keeps a graph-broken frame's compiled
    # function in that module's globals) would be shared: this test watches a driver of its own
    monkeypatch.setattr(step_driver, "_DRIVER", None)
    before = len(_global_optimizer_post_hooks)
    model = MLP()
    nmcompile.annotate(model, "mdgf:2:4")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    compiled(torch.randn(2, 16))
    assert len(_global_optimizer_post_hooks) == before + 1
    del compiled, model
    torch._dynamo.reset()
    gc.collect()
    assert len(_global_optimizer_post_hooks) == before


def _compile_warnings(model, options, x=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="nmsparse", options={**options, **AOT})(torch.randn(2, 16) if x is None else x)
    return [str(w.message) for w in caught if "nmsparse" in str(w.message)]


@pytest.mark.parametrize("options, reason", [
    ({"recipe": "sr_ste:2:4", "include": ["encoder.*"]}, "include glob 'encoder.*' matches none"),
    ({"recipe": "sr_ste:2:4", "exclude": ["*"]}, "exclude glob '*' removes 3"),
    ({"recipe": {"decoder.*": "sr_ste:2:4"}}, "rule 'decoder.*' matches none"),
])
def test_options_that_select_nothing_are_named(options, reason):
    messages = _compile_warnings(MLP(), options)
    assert any("selects none of the 3 weights" in m and reason in m for m in messages), messages
    with pytest.raises(Exception, match="strict=True"):  # Dynamo wraps it in BackendCompilerFailed
        torch._dynamo.reset()
        torch.compile(MLP(), backend="nmsparse", options={**options, **AOT, "strict": True})(torch.randn(2, 16))


def test_an_empty_rules_file_in_the_environment_is_named(tmp_path, monkeypatch):
    rules = tmp_path / "rules.toml"
    rules.write_text("# nothing yet\n")
    monkeypatch.setenv("NMSPARSE_RECIPE", str(rules))
    messages = _compile_warnings(MLP(), {})
    assert any("NMSPARSE_RECIPE declaration selects none" in m and "no rules" in m for m in messages), messages


def test_an_explicit_dense_rule_is_not_a_mistake():
    assert not _compile_warnings(MLP(), {"recipe": {"*": "dense"}})


class Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.deconv = nn.ConvTranspose2d(8, 8, 3)
        self.conv3d = nn.Conv3d(8, 8, 1)
        self.bilinear = nn.Bilinear(8, 8, 8)
        self.t = nn.Parameter(torch.randn(8, 8))
        self.e = nn.Parameter(torch.randn(8, 8))
        self.ok = nn.Linear(8, 8)

    def forward(self, x):
        img = x[:, :, None, None].expand(-1, -1, 4, 4)
        a = self.deconv(img).mean((2, 3)) + self.conv3d(img[:, :, None]).mean((2, 3, 4))
        b = self.bilinear(x, x)
        c = x @ self.t.t() + torch.einsum("bi,oi->bo", x, self.e)
        return self.ok(a + b + c)


def test_unsupported_layers_reached_by_a_declaration_are_named():
    messages = _compile_warnings(Unsupported(), {"recipe": "sr_ste:2:4"}, torch.randn(2, 8))
    assert len(messages) == 1  # one summary for the graph
    for name in ("deconv.weight", "conv3d.weight", "bilinear.weight", "t", "e"):
        assert f"\n  {name}: " in messages[0], (name, messages[0])
    assert "ok.weight" not in messages[0]


def test_training_a_finalized_model_is_named_and_the_named_fix_keeps_the_pattern():
    model = MLP()
    nmcompile.annotate(model, "sr_ste:2:4")
    _train(model, torch.compile(model, backend="nmsparse", options=AOT), 2)
    nmcompile.finalize(model)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="finalized N:M weights fc1.weight, fc2.weight, fc3.weight.*asp:2:4,permute"):
        torch.compile(model, backend="nmsparse", options=AOT)(torch.randn(2, 16)).sum().backward()
    model.zero_grad()
    nmcompile.annotate(model, "asp:2:4,permute=False")
    torch._dynamo.reset()
    _train(model, torch.compile(model, backend="nmsparse", options=AOT), 3, seed=1)
    nmcompile.finalize(model)
    assert nmcompile.check(model).ok and len(nmcompile.check(model)) == 3


def test_a_declared_weight_that_trains_without_any_nmsparse_graph_is_named_once():
    model = MLP()
    nmcompile.annotate(model, "s_ste:2:4", exclude=["fc3"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, model, 3)  # eager: the declaration never reaches a graph
    named = [str(w.message) for w in caught if "no torch.compile(..., backend='nmsparse') graph" in str(w.message)]
    assert len(named) == 1 and "fc1.weight (s_ste:2:4), fc2.weight (s_ste:2:4)" in named[0], named
    compiled_model = MLP()
    nmcompile.annotate(compiled_model, "s_ste:2:4")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(compiled_model, torch.compile(compiled_model, backend="nmsparse", options=AOT), 2)
    assert not [w for w in caught if "no torch.compile" in str(w.message)]


class Eager(nn.Linear):
    """A layer Dynamo runs outside the graph (as it does a layer it cannot trace)."""

    @torch.compiler.disable
    def forward(self, x):
        return super().forward(x)


class WithEagerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.eager = Eager(8, 8)

    def forward(self, x):
        return self.eager(torch.relu(self.fc(x)))


def test_layers_dynamo_runs_outside_every_graph_are_named_at_the_first_step():
    model = WithEagerLayer()
    compiled = torch.compile(model, backend="nmsparse", options={"recipe": "sr_ste:2:4", **AOT})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    named = [str(w.message) for w in caught if "selected by the declaration but no nmsparse graph" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]
    assert "eager.weight (sr_ste:2:4 from options, Eager)" in named[0]
    assert "fc.weight" not in named[0]  # rewritten: not dense
    assert sorted(nmcompile.effective_weights(model)) == ["fc.weight"]
