import pytest
import torch
from torch import nn

import nmcompile
from nmcompile import recipes
from nmcompile.declare.plan import Plan


def test_first_matching_rule_wins():
    plan = Plan.build({"enc.*.fc1.weight": "s_ste", "enc.*": "dense", "*": "sr_ste"})
    assert plan.recipe_for("enc.0.fc1.weight") == recipes.SSTE()
    assert plan.recipe_for("enc.0.fc2.weight") is None
    assert plan.recipe_for("dec.fc.weight") == recipes.SRSTE()


def test_include_exclude_match_parameter_or_module_names():
    plan = Plan.build("ste", include=["enc.*"], exclude=["enc.1"])
    assert plan.recipe_for("enc.0.weight") == recipes.STE()
    assert plan.recipe_for("enc.1.weight") is None  # module name matched by exclude
    assert plan.recipe_for("head.weight") is None
    assert "exclude" in plan.filtered_out("enc.1.weight")


def test_toml_rules_file(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text(
        'exclude = ["*.head.*"]\nrecipe = "ste:1:4"\n[rules]\n"*.fc1.weight" = "s_ste:2:4"\n"*.attn.*" = "dense"\n'
    )
    plan = Plan.build(str(path))
    assert plan.recipe_for("blk.fc1.weight") == recipes.SSTE()
    assert plan.recipe_for("blk.attn.q.weight") is None
    assert plan.recipe_for("blk.fc2.weight") == recipes.STE(n=1, m=4)
    assert plan.recipe_for("m.head.out.weight") is None


@pytest.mark.parametrize(
    "text,match",
    [
        ('recipes = "ste"\n', "unknown key 'recipes'.*did you mean 'recipe'"),
        ('[rules]\n"*" = "sr_stee"\n', "unknown recipe 'sr_stee'.*did you mean 'sr_ste'"),
        ('[rules]\n"*" = "sr_ste,decey=1"\n', "unknown key 'decey'.*did you mean 'decay'"),
        ("[rules\n", "not valid TOML"),
    ],
)
def test_toml_errors_name_the_problem(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        Plan.build(str(path))


def test_missing_toml_file():
    with pytest.raises(ValueError, match="does not exist"):
        Plan.build("/nonexistent/rules.toml")


@pytest.mark.parametrize(
    "spec,match",
    [
        ("nope", "unknown recipe 'nope'.*accepted: ste, sr_ste, s_ste"),
        ("sr_ste:4:2", "need 1 <= N < M"),
        ("sr_ste:0:4", "need 1 <= N < M"),
        ("s_ste,betaa=2", "unknown key 'betaa'"),
        ("sr_ste:2", "NAME:N:M"),
        ("sr_ste,decay", "expected key=value"),
        ("sr_ste,decay=-1", "decay must be >= 0"),
    ],
)
def test_recipe_string_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        nmcompile.recipe(spec)


def test_env_plan(monkeypatch, tmp_path):
    assert Plan.from_env({}) is None
    assert Plan.from_env({"NMSPARSE_RECIPE": "sr_ste:1:4"}).recipe_for("x.weight") == recipes.SRSTE(n=1, m=4)
    path = tmp_path / "r.toml"
    path.write_text('[rules]\n"a.*" = "ste"\n')
    assert Plan.from_env({"NMSPARSE_RECIPE": str(path)}).recipe_for("a.weight") == recipes.STE()
    with pytest.raises(ValueError, match="NMSPARSE_RECIPE='bogus'.*unknown recipe"):
        Plan.from_env({"NMSPARSE_RECIPE": "bogus"})


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 12)
        self.odd = nn.Linear(12, 6)
        self.tail = nn.Linear(6, 10)  # in=6 is not divisible by 4
        self.conv = nn.Conv2d(4, 8, 3)
        self.stem = nn.Conv2d(3, 4, 3)  # 3 input channels
        self.register_parameter("codes", nn.Parameter(torch.zeros(4, 8, dtype=torch.int32), requires_grad=False))


def test_annotate_reports_annotated_and_skipped_with_reasons():
    net = Net()
    before = {name: type(m) for name, m in net.named_modules()}
    report = nmcompile.annotate(net, "sr_ste:2:4")
    assert {name: type(m) for name, m in net.named_modules()} == before  # no module swap
    assert set(report.annotated) == {"fc.weight", "odd.weight", "conv.weight"}
    assert "embedding" in report.skipped["emb.weight"]
    assert "not divisible by M=4" in report.skipped["tail.weight"]
    assert "not divisible by M=4" in report.skipped["stem.weight"]
    assert "integer" in report.skipped["codes"]
    assert "fc.weight" in str(report) and "tail.weight" in str(report)


def test_strict_turns_skips_into_errors_naming_the_parameter():
    with pytest.raises(ValueError, match="'tail.weight'.*not divisible by M=4.*pad it to 8"):
        nmcompile.annotate(Net(), "ste", strict=True, exclude=["emb", "codes"])


def test_tied_weights_are_never_sparsified():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.b.weight = self.a.weight

    report = nmcompile.annotate(Tied(), "ste")
    assert report.annotated == {}
    assert "tied to head.weight" in report.skipped["emb.weight"]
    assert "shared by a.weight, b.weight" in report.skipped["a.weight"]


def test_annotate_rejects_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        nmcompile.annotate({"w": torch.zeros(4, 4)}, "ste")
    with pytest.raises(TypeError, match="recipe_or_rules takes"):
        nmcompile.annotate(nn.Linear(4, 4), 42)


def test_reannotating_with_same_recipe_keeps_state():
    lin = nn.Linear(8, 8)
    nmcompile.annotate(lin, "s_ste")
    beta = lin.weight_nm_beta.clone()
    with torch.no_grad():
        lin.weight.mul_(3.0).add_(1.0)
    nmcompile.annotate(lin, "s_ste")
    assert torch.equal(lin.weight_nm_beta, beta)  # beta is computed once
    nmcompile.annotate(lin, "ste")
    assert "weight_nm_beta" not in dict(lin.named_buffers())


def test_a_filter_glob_that_matches_nothing_is_named_with_the_closest_names():
    import warnings

    wrapper = nn.Module()
    wrapper.module = nn.Sequential()
    wrapper.module.fc1, wrapper.module.fc3 = nn.Linear(64, 64), nn.Linear(64, 64)
    with pytest.warns(UserWarning, match=r"exclude glob 'fc3' matches no parameter or module name; it is the end of "
                                         r"'module.fc3': .* write '\*.fc3'"):
        report = nmcompile.annotate(wrapper, "sr_ste:2:4", exclude=["fc3"])
    assert "module.fc3.weight" in report.annotated  # the glob excluded nothing
    with pytest.warns(UserWarning, match=r"include glob 'module.fc4' matches no .*closest names: 'module.fc3'"):
        nmcompile.annotate(wrapper, "sr_ste:2:4", include=["module.fc1", "module.fc4"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = nmcompile.annotate(wrapper, "sr_ste:2:4", exclude=["*.fc3"])
    assert list(report.annotated) == ["module.fc1.weight"]
