"""The nmsparse backend: declaration routes, state, recompiles, errors."""

import subprocess
import sys
import textwrap

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import nmcompile
from nmcompile.state import records
from nmcompile.declare.annotate import WeightAnnotation, annotation_of
from nmcompile import recipes
from nmcompile.backends.inner import parse_options

AOT = {"inner": "aot_eager"}


class MLP(nn.Module):
    def __init__(self, regions=False):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        self.regions = regions

    def forward(self, x):
        if self.regions:
            with nmcompile.region("s_ste:2:4"):
                x = torch.relu(self.fc1(x))
            with nmcompile.region("dense"):
                x = torch.relu(self.fc2(x))
        else:
            x = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.fc3(x)


def backend_error(info):
    """Dynamo reports a backend's exception as BackendCompilerFailed(inner_exception=...)."""
    return getattr(info.value, "inner_exception", info.value)


def eager_with(model, x):
    """The model's forward in eager mode with every annotated weight replaced by its effective weight."""
    params = {**dict(model.named_parameters()), **nmcompile.effective_weights(model)}
    return torch.func.functional_call(model, params, (x,))


@pytest.mark.slow
def test_backend_found_by_entry_point_without_import():
    code = textwrap.dedent(
        """
        import sys, torch
        assert "nmsparse" in torch._dynamo.list_backends()
        m = torch.nn.Linear(8, 4)
        out = torch.compile(m, backend="nmsparse", options={"recipe": "ste", "inner": "aot_eager"})(torch.randn(2, 8))
        assert "nmcompile" in sys.modules
        import nmcompile
        assert list(nmcompile.effective_weights(m)) == ["weight"]
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().endswith("ok"), result.stderr[-2000:]


@pytest.mark.slow
def test_options_route_with_include_exclude():
    model = MLP()
    compiled = torch.compile(
        model, backend="nmsparse", options={"recipe": "sr_ste:1:4", "include": ["fc1", "fc2"], "exclude": ["fc2"], **AOT}
    )
    x = torch.randn(4, 16)
    out = compiled(x)
    eff = nmcompile.effective_weights(model)
    assert list(eff) == ["fc1.weight"]
    assert nmcompile.check(model).ok
    torch.testing.assert_close(out, eager_with(model, x))


def test_env_route(monkeypatch, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[rules]\n"fc3" = "dense"\n"*" = "s_ste:2:4"\n')
    monkeypatch.setenv("NMSPARSE_RECIPE", str(rules))
    model = MLP()
    x = torch.randn(4, 16)
    out = torch.compile(model, backend="nmsparse", options=AOT)(x)
    assert sorted(nmcompile.effective_weights(model)) == ["fc1.weight", "fc2.weight"]
    assert "fc1.weight_nm_beta" in model.state_dict()
    torch.testing.assert_close(out, eager_with(model, x))


def test_region_route_without_graph_break():
    model = MLP(regions=True)
    x = torch.randn(4, 16)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0
    torch._dynamo.reset()
    out = torch.compile(model, backend="nmsparse", options={"recipe": "ste", **AOT})(x)
    eff = nmcompile.effective_weights(model)
    assert sorted(eff) == ["fc1.weight", "fc3.weight"]  # fc2 opted out by its dense region
    assert annotation_of(model.fc1, "weight").recipe == recipes.SSTE()  # the region's recipe, not the options'
    assert annotation_of(model.fc3, "weight").recipe == recipes.STE()
    torch.testing.assert_close(out, eager_with(model, x))


def test_annotate_takes_precedence_over_options():
    model = MLP()
    nmcompile.annotate(model, {"fc1": "s_ste"})
    torch.compile(model, backend="nmsparse", options={"recipe": "ste", **AOT})(torch.randn(2, 16))
    assert annotation_of(model.fc1, "weight").recipe == recipes.SSTE()
    assert annotation_of(model.fc2, "weight").recipe == recipes.STE()


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_eval_and_no_grad_graphs_use_effective_weights(inner):
    model = MLP()
    nmcompile.annotate(model, "s_ste")
    compiled = torch.compile(model, backend="nmsparse", options={"inner": inner})
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager_with(model, x))
    model.eval()
    torch.testing.assert_close(compiled(x), eager_with(model, x))


def _train(model, opt, compiled, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss


def test_state_dict_resume_matches_uninterrupted_run(tmp_path):
    torch.manual_seed(0)
    full = MLP()
    resumed = MLP()
    resumed.load_state_dict(full.state_dict())
    nmcompile.annotate(full, "s_ste")
    opt = torch.optim.Adam(full.parameters(), lr=1e-2)
    compiled = torch.compile(full, backend="nmsparse", options=AOT)
    _train(full, opt, compiled, 3, seed=1)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": full.state_dict(), "opt": opt.state_dict()}, path)
    _train(full, opt, compiled, 3, seed=2)

    ckpt = torch.load(path)
    nmcompile.annotate(resumed, "s_ste")
    resumed.fc1.weight_nm_beta.fill_(0.0)
    resumed.load_state_dict(ckpt["model"])  # restores the weights and beta
    assert torch.equal(resumed.fc1.weight_nm_beta, ckpt["model"]["fc1.weight_nm_beta"])
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    opt2.load_state_dict(ckpt["opt"])
    _train(resumed, opt2, torch.compile(resumed, backend="nmsparse", options=AOT), 3, seed=2)
    for name, p in full.named_parameters():
        torch.testing.assert_close(p, resumed.get_parameter(name), rtol=0, atol=0)


def test_one_graph_serves_many_instances_with_their_own_state():
    a, b = MLP(), MLP()
    nmcompile.annotate(a, "s_ste")
    x = torch.randn(4, 16)
    ca = torch.compile(a, backend="nmsparse", options={"recipe": "s_ste", **AOT})
    cb = torch.compile(b, backend="nmsparse", options={"recipe": "s_ste", **AOT})
    counters.clear()
    out_a, out_b = ca(x), cb(x)
    assert counters["stats"]["unique_graphs"] == 1  # b reuses a's graph ...
    assert not torch.equal(a.fc1.weight_nm_beta, b.fc1.weight_nm_beta)  # ... with its own beta
    torch.testing.assert_close(out_a, eager_with(a, x))
    torch.testing.assert_close(out_b, eager_with(b, x))


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_instances_with_other_recipes_share_the_dynamo_graph(inner):
    models = [MLP() for _ in range(3)]
    for model, recipe in zip(models, ["ste", "s_ste:1:4", "ste"]):
        nmcompile.annotate(model, recipe)
    compiled = [torch.compile(m, backend="nmsparse", options={"inner": inner}) for m in models]
    x = torch.randn(4, 16)
    counters.clear()
    for _ in range(2):
        for model, run in zip(models, compiled):
            torch.testing.assert_close(run(x), eager_with(model, x))
    assert counters["stats"]["unique_graphs"] == 1
    del models[0], compiled[0]  # the model the graph was traced from may go away
    nmcompile.annotate(models[1], "sr_ste")  # re-annotated after compiling
    torch.testing.assert_close(compiled[0](x), eager_with(models[0], x))


def test_recipe_that_does_not_fit_the_compiled_graph_is_an_error():
    a, b = MLP(), MLP()
    nmcompile.annotate(a, "ste")
    nmcompile.annotate(b, "ste:1:32", include=["fc2"])  # fc1 (16 inputs) cannot take 1:32
    records.put(b.fc1, records.RECIPES, "weight", WeightAnnotation(recipes.STE(n=1, m=32), 1))
    torch.compile(a, backend="nmsparse", options=AOT)(torch.randn(2, 16))
    with pytest.raises(RuntimeError, match="'fc1.weight' was compiled with recipe ste:2:4.*reset"):
        torch.compile(b, backend="nmsparse", options=AOT)(torch.randn(2, 16))


@pytest.mark.parametrize("name", ["ste", "sr_ste", "s_ste"])
def test_twenty_steps_one_compilation(name):
    model = MLP()
    nmcompile.annotate(model, name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    counters.clear()
    _train(model, opt, compiled, 20, seed=0)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    assert nmcompile.check(model).ok


def test_unknown_option_lists_accepted_with_nearest():
    with pytest.raises(Exception) as info:
        torch.compile(MLP(), backend="nmsparse", options={"recipie": "ste"})(torch.randn(2, 16))
    cause = backend_error(info)
    assert isinstance(cause, ValueError)
    assert "unknown nmsparse option 'recipie' (did you mean 'recipe'?)" in str(cause)


@pytest.mark.inductor
def test_options_pass_inductor_settings_and_mode_through():
    plan, inner, train_kernel = parse_options({"recipe": "ste", "epilogue_fusion": False}, None)
    assert inner.name == "inductor" and inner.patches == {"epilogue_fusion": False} and train_kernel == "auto"
    _, inner, train_kernel = parse_options({"train_kernel": "reference"}, "max-autotune-no-cudagraphs")
    assert inner.patches.get("max_autotune") is True and train_kernel == "reference"
    with pytest.raises(ValueError, match="train_kernel='cusparseLt' is not one of .* \\(did you mean 'cusparselt'\\?\\)"):
        parse_options({"train_kernel": "cusparseLt"}, None)
    with pytest.raises(ValueError, match="need inner='inductor'"):
        parse_options({"inner": "aot_eager", "epilogue_fusion": False}, None)
    with pytest.raises(ValueError, match="inner='bogus' is not one of"):
        parse_options({"inner": "bogus"}, None)
    with pytest.raises(ValueError, match="projections='fused' is not one of auto, inline, shared"):
        parse_options({"projections": "fused"}, None)
    with pytest.raises(ValueError, match="need a 'recipe'"):
        parse_options({"include": ["fc1"]}, None)
    # torch.compile refuses mode= beside options=: the mode can come as an option
    _, inner, train_kernel = parse_options({"mode": "reduce-overhead", "train_kernel": "dense"}, None)
    assert inner.patches.get("triton.cudagraphs") is True and inner.cuda_graphs and train_kernel == "dense"
    assert not parse_options({}, None)[1].cuda_graphs and not parse_options({}, "max-autotune-no-cudagraphs")[1].cuda_graphs
    with pytest.raises(ValueError, match="mode='fast' is not one of"):
        parse_options({"mode": "fast"}, None)
    with pytest.raises(ValueError, match="give the mode once"):
        parse_options({"mode": "reduce-overhead"}, "max-autotune")


def test_bad_recipe_in_options_is_a_value_error():
    with pytest.raises(Exception) as info:
        torch.compile(MLP(), backend="nmsparse", options={"recipe": "sr_ste:4:4"})(torch.randn(2, 16))
    assert isinstance(backend_error(info), ValueError)
    assert "need 1 <= N < M" in str(info.value)


class Layers(nn.Module):
    """conv1d, conv2d, GPT-2-style addmm with a [in, out] weight, matmul, and an unsupported use."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 8, 3)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.w_in_out = nn.Parameter(torch.randn(8, 12))
        self.b = nn.Parameter(torch.zeros(12))
        self.w_norm = nn.Parameter(torch.randn(8, 12))

    def forward(self, x):
        y = self.c1(x)  # [B, 8, L]
        y = self.c2(y.unsqueeze(-1)).squeeze(-1)
        y = torch.addmm(self.b, y.mean(-1), self.w_in_out)
        return (y @ self.w_in_out.T) @ self.w_norm * self.w_norm.norm()


def test_conv_addmm_matmul_consumers():
    model = Layers()
    x = torch.randn(2, 4, 10)
    out = torch.compile(model, backend="nmsparse", options={"recipe": "ste", **AOT})(x)
    eff = nmcompile.effective_weights(model)
    assert sorted(eff) == ["c1.weight", "c2.weight"]  # w_in_out is also transposed, w_norm also normed
    assert ((eff["c2.weight"] != 0).movedim(1, -1).unflatten(-1, (-1, 4)).sum(-1) == 2).all()
    torch.testing.assert_close(out, eager_with(model, x))


def test_addmm_weight_groups_along_dim_0():
    class Conv1DLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(16, 6)), nn.Parameter(torch.zeros(6))

        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight)

    model = Conv1DLike()
    x = torch.randn(3, 16)
    out = torch.compile(model, backend="nmsparse", options={"recipe": "ste", **AOT})(x)
    w = nmcompile.effective_weights(model)["weight"]
    assert ((w != 0).unflatten(0, (-1, 4)).sum(1) == 2).all()
    torch.testing.assert_close(out, x @ w + model.bias)


def test_nothing_declared_warns_and_trains_dense():
    model = MLP()
    x = torch.randn(2, 16)
    with pytest.warns(UserWarning, match="no N:M recipe is declared for any of 3 weights.*fc1.weight"):
        out = torch.compile(model, backend="nmsparse", options=AOT)(x)
    torch.testing.assert_close(out, model(x))
    assert nmcompile.effective_weights(model) == {}


def test_backend_skips_are_warned_with_reasons():
    model = Layers()
    with pytest.warns(UserWarning, match=r"left these weights dense:\n  w_in_out: also used by"):
        torch.compile(model, backend="nmsparse", options={"recipe": "ste", **AOT})(torch.randn(2, 4, 10))


def test_annotated_weight_the_graph_cannot_rewrite_is_reported():
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return x @ self.fc.weight.t()  # no linear/matmul takes the weight itself

    model = Transposed()
    nmcompile.annotate(model, "ste")
    with pytest.warns(UserWarning, match="fc.weight: used only by call_method t.*recipe ste:2:4 from annotate"):
        torch.compile(model, backend="nmsparse", options=AOT)(torch.randn(2, 8))


def test_dynamic_shapes_train_and_refuse_unsafe_variants():
    a, b = MLP(), MLP()
    nmcompile.annotate(a, "s_ste")
    nmcompile.annotate(b, "ste")
    ca = torch.compile(a, backend="nmsparse", options=AOT, dynamic=True)
    for batch in (2, 5, 9):
        x = torch.randn(batch, 16)
        torch.testing.assert_close(ca(x), eager_with(a, x))
    with pytest.raises(RuntimeError, match="dynamic shapes.*reset"):
        torch.compile(b, backend="nmsparse", options=AOT, dynamic=True)(torch.randn(3, 16))


def test_in_place_module_compile():
    # model.compile(...) is how to use nmsparse where a framework (the HF Trainer) rejects the name
    model = MLP()
    model.compile(backend="nmsparse", options={"recipe": "sr_ste", **AOT})
    x = torch.randn(4, 16)
    out = model(x)
    assert sorted(nmcompile.effective_weights(model)) == ["fc1.weight", "fc2.weight", "fc3.weight"]
    torch.testing.assert_close(out, eager_with(model, x))


def test_deepcopy_keeps_the_record_and_compiles_sparse():
    import copy

    model = MLP()
    nmcompile.annotate(model, "s_ste")
    twin = copy.deepcopy(model)
    x = torch.randn(2, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(twin, backend="nmsparse", options=AOT)(x)
    assert not [w for w in caught if "nmsparse" in str(w.message)]  # e.g. "no N:M recipe is declared"
    torch.testing.assert_close(out, eager_with(model, x))
    torch.testing.assert_close(twin.fc1.weight_nm_beta, model.fc1.weight_nm_beta)
    nmcompile.annotate(twin, "s_ste")  # annotating the copy again is a no-op that keeps its state
    torch.testing.assert_close(twin.fc1.weight_nm_beta, model.fc1.weight_nm_beta)


@pytest.mark.inductor
@pytest.mark.slow
def test_bi_mask_under_inductor_trains_and_evaluates_at_another_batch_size():
    """Backend-made inputs (Bi-Mask's permutation) are static: a reshape of rows indexed by it once
    made Dynamo's guard building fail under Inductor."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16))
    nmcompile.annotate(model, "bi_mask:2:4")
    compiled = torch.compile(model, backend="nmsparse", dynamic=False)
    opt = torch.optim.Adam(model.parameters())
    nmcompile.hook_optimizer(model, opt)
    for _ in range(2):
        loss = compiled(torch.randn(8, 64)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        x = torch.randn(20, 64)
        expected = torch.func.functional_call(model, {**dict(model.named_parameters()), **nmcompile.effective_weights(model)}, (x,))
        torch.testing.assert_close(compiled(x), expected, atol=1e-5, rtol=1e-4)


def test_nmsparse_inner_names_the_inner_compiler_where_the_options_do_not(monkeypatch):
    from nmcompile.backends.inner import parse_options

    monkeypatch.setenv("NMSPARSE_INNER", "eager")
    assert parse_options(None, None)[1].name == "eager"
    assert parse_options({"recipe": "ste:2:4"}, None)[1].name == "eager"
    assert parse_options({"inner": "aot_eager"}, None)[1].name == "aot_eager"  # the options win
    # options only Inductor reads ask for Inductor: the variable does not apply
    for options, mode in (({"projections": "shared"}, None), ({"epilogue_fusion": False}, None), (None, "max-autotune")):
        assert parse_options(options, mode)[1].name == "inductor"
    monkeypatch.setenv("NMSPARSE_INNER", "aot-eager")
    with pytest.raises(ValueError, match=r"nmsparse \$NMSPARSE_INNER='aot-eager' is not one of inductor, aot_eager"):
        parse_options(None, None)
    monkeypatch.delenv("NMSPARSE_INNER")
    assert parse_options(None, None)[1].name == "inductor"
