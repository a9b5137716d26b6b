"""Channel permutation for one-shot N:M pruning: the search and its function-preserving use."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nmcompile.masks import keep_mask
from nmcompile.masks import permutation as perm_mod
from nmcompile.masks.permutation import kept_magnitude, search_permutation
from nmcompile.permute_channels import PermutationReport, permute_channels


def _is_permutation(p: torch.Tensor, c: int) -> bool:
    return p.dtype == torch.long and p.shape == (c,) and torch.equal(p.sort().values, torch.arange(c))


def _kept_dim1(w: torch.Tensor, n: int = 2, m: int = 4) -> float:
    w = w.detach().double()
    return float((w.abs() * keep_mask(w, n, m, 1)).sum())


# ----------------------------------------------------------------------------------------------
# the search


def test_kept_magnitude_by_hand():
    w = torch.tensor([[1.0, -3.0, 2.0, -0.5, 0.0, 4.0, 0.0, -1.0]])
    assert kept_magnitude(w, 2, 4) == pytest.approx(3.0 + 2.0 + 4.0 + 1.0)
    assert kept_magnitude(w, 1, 4) == pytest.approx(3.0 + 4.0)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (1, 2)], ids=str)
@pytest.mark.parametrize("kind", ["gauss", "ties", "sparse"])
def test_search_is_a_permutation_that_never_loses(n, m, kind):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 16 * m, generator=gen)
    if kind == "ties":
        w = torch.randint(-2, 3, w.shape, generator=gen).float()
    elif kind == "sparse":
        w = w * (torch.rand(w.shape, generator=gen) < 0.2)
    p = search_permutation(w, n, m)
    assert _is_permutation(p, w.shape[1])
    assert kept_magnitude(w[:, p], n, m) >= kept_magnitude(w, n, m)


def test_search_gains_on_gaussian_matrices(capsys):
    for seed in range(2):
        w = torch.randn(256, 256, generator=torch.Generator().manual_seed(seed))
        p = search_permutation(w, 2, 4)
        assert _is_permutation(p, 256)
        before, after = kept_magnitude(w, 2, 4), kept_magnitude(w[:, p], 2, 4)
        assert after > before
        assert (after - before) / before > 0.005  # about 2% on this size; 0.5% is a loose floor
    assert capsys.readouterr() == ("", "")


def _collision_matrix(groups: int, m: int, types: int, seed: int) -> torch.Tensor:
    """Columns of ``types`` kinds, each kind non-zero only on its own block of rows. A group with
    m/types columns of every kind has at most m/types non-zeros per row, so at n = m/types the
    optimum keeps everything. Column norms fall with the index and the kind is (c % groups) %
    types, so the sort-by-norm start deals columns of one kind into the same group."""
    gen = torch.Generator().manual_seed(seed)
    rows_per, c = 8, m * groups
    w = torch.zeros(rows_per * types, c)
    for col in range(c):
        kind = (col % groups) % types
        w[kind * rows_per : (kind + 1) * rows_per, col] = 2 - col / c + 0.1 * torch.rand(rows_per, generator=gen)
    return w[:, torch.randperm(c, generator=gen)]  # scrambled: large entries collide in groups


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8)], ids=str)
@pytest.mark.parametrize("groups", [8, 32])
def test_search_reaches_the_known_optimum(n, m, groups):
    w = _collision_matrix(groups, m, m // n, seed=groups)
    optimum = float(w.double().abs().sum())
    assert kept_magnitude(w, n, m) < 0.95 * optimum  # the start is far from it
    p = search_permutation(w, n, m)
    assert kept_magnitude(w[:, p], n, m) == pytest.approx(optimum, rel=1e-9)


def test_search_is_deterministic_also_in_blocked_mode(monkeypatch):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    assert torch.equal(search_permutation(w, 2, 4, seed=7), search_permutation(w, 2, 4, seed=7))
    # force the large-matrix path (random blocks of groups) on a small matrix
    monkeypatch.setattr(perm_mod, "_FULL_EVALS", 0)
    monkeypatch.setattr(perm_mod, "_BLOCK_GROUPS", 8)
    runs = [search_permutation(w, 2, 4, seed=s) for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1])
    for p in runs:
        assert _is_permutation(p, 256)
        assert kept_magnitude(w[:, p], 2, 4) > kept_magnitude(w, 2, 4)


def test_search_identity_when_nothing_can_improve():
    w = torch.randn(8, 4)
    assert torch.equal(search_permutation(w, 2, 4), torch.arange(4))  # C <= m
    w = torch.randn(8, 16)
    assert torch.equal(search_permutation(w, 4, 4), torch.arange(16))  # keeps everything
    assert torch.equal(search_permutation(torch.zeros(8, 16), 2, 4), torch.arange(16))
    assert torch.equal(search_permutation(torch.ones(8, 16), 2, 4), torch.arange(16))  # all ties
    with pytest.raises(ValueError):
        search_permutation(torch.randn(8, 10), 2, 4)


def test_search_bounds_still_give_a_valid_result():
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(2))
    base = kept_magnitude(w, 2, 4)
    for kwargs in ({"max_rounds": 1}, {"time_limit": 0.0}, {"max_evals": 1}):
        p = search_permutation(w, 2, 4, **kwargs)
        assert _is_permutation(p, 128)
        assert kept_magnitude(w[:, p], 2, 4) >= base
    one = kept_magnitude(w[:, search_permutation(w, 2, 4, max_rounds=1)], 2, 4)
    full = kept_magnitude(w[:, search_permutation(w, 2, 4)], 2, 4)
    assert full > one > base


# ----------------------------------------------------------------------------------------------
# models


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(self.act(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 8, 1)

    def forward(self, x):
        return self.conv3(torch.relu(self.conv2(F.relu(self.bn(self.conv1(x))))))


class CNN1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 32, 3)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.1)
        self.conv2 = nn.Conv1d(32, 16, 3)

    def forward(self, x):
        return self.conv2(F.dropout(F.silu(self.drop(self.bn(self.conv1(x)))), 0.2, self.training))


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 64)
        self.head_a = nn.Linear(64, 8)
        self.head_b = nn.Linear(64, 12)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.head_a(h), self.head_b(nn.functional.leaky_relu(h, 0.1))


def _randomize_bn(model):
    for mod in model.modules():
        if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
            with torch.no_grad():
                mod.weight.uniform_(0.5, 2.0)
                mod.bias.normal_()
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _outputs(model, x):
    with torch.no_grad():
        y = model(x)
    return y if isinstance(y, tuple) else (y,)


CASES = [
    (MLP, (5, 16), ["fc2.weight", "fc3.weight"], {("fc2.weight",): "fc1", ("fc3.weight",): "fc2"}),
    (CNN, (2, 3, 8, 8), ["conv2.weight", "conv3.weight"],
     {("conv2.weight",): "conv1", ("conv3.weight",): "conv2"}),
    (CNN1d, (2, 4, 20), ["conv2.weight"], {("conv2.weight",): "conv1"}),
    (TwoHeads, (5, 16), ["head_a.weight", "head_b.weight"], {("head_a.weight", "head_b.weight"): "trunk"}),
]


@pytest.mark.parametrize("make,shape,names,expected", CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_permutation_preserves_function_and_gains(make, shape, names, expected):
    model = _randomize_bn(make())
    x = torch.randn(shape)
    before_out = _outputs(model, x)
    params = dict(model.named_parameters())
    kept_before = {name: _kept_dim1(params[name]) for name in names}
    report = permute_channels(model, names, 2, 4)
    assert isinstance(report, PermutationReport)
    assert report.skipped == {}
    assert {tuple(g.consumers): g.producer for g in report.groups} == expected
    for a, b in zip(_outputs(model, x), before_out):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for name in names:
        assert _kept_dim1(params[name]) > kept_before[name], name
    for group in report.groups:
        assert group.kept_after > group.kept_before
        assert group.gain == pytest.approx((group.kept_after - group.kept_before) / group.kept_before)
    assert report.total_gain > 0
    text = str(report)
    for group in report.groups:
        assert group.producer in text and all(c in text for c in group.consumers)


def test_report_records_batchnorm_and_sums_gain():
    model = _randomize_bn(CNN())
    report = permute_channels(model, ["conv2.weight", "conv3.weight"], 2, 4)
    assert [g.batchnorms for g in report.groups] == [["bn"], []]
    before = sum(g.kept_before for g in report.groups)
    after = sum(g.kept_after for g in report.groups)
    assert report.total_gain == pytest.approx((after - before) / before)
    # the group's kept magnitude is the consumers' kept magnitude along dim 1
    assert report.groups[0].kept_after == pytest.approx(_kept_dim1(model.conv2.weight), rel=1e-6)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 8)

    def forward(self, x):
        h = self.fc1(x)
        h = h + torch.relu(self.fc2(h))
        return self.fc3(h)


class WithLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


class ConvFlatten(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        h = self.fc1(x)
        if h.sum() > 0:
            h = -h
        return self.fc2(h)


SKIPS = [
    (Residual, ["fc2.weight", "fc3.weight"], {"fc2.weight": "add", "fc3.weight": "add"}),
    (MLP, ["fc1.weight"], {"fc1.weight": "model input"}),
    (WithLayerNorm, ["fc2.weight"], {"fc2.weight": "LayerNorm"}),
    (ConvFlatten, ["fc.weight"], {"fc.weight": "flatten"}),
    (DataDependent, ["fc2.weight"], {"fc2.weight": "tracing failed"}),
    (TwoHeads, ["head_a.weight"], {"head_a.weight": "head_b"}),  # a sibling not in names
    (MLP, ["fc2.bias", "act.weight", "missing.weight"],
     {"fc2.bias": "not the weight", "act.weight": "not the weight", "missing.weight": "not the weight"}),
]


@pytest.mark.parametrize("make,names,reasons", SKIPS, ids=lambda v: getattr(v, "__name__", ""))
def test_unsafe_permutations_are_skipped_and_the_model_left_alone(make, names, reasons):
    model = make()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = permute_channels(model, names, 2, 4)
    assert report.groups == []
    assert set(report.skipped) == set(reasons)
    for name, word in reasons.items():
        assert word in report.skipped[name], report.skipped[name]
        assert name in str(report)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_already_annotated_weights_are_left_alone():
    from nmcompile import records

    model = MLP()
    records.put(model.fc1, records.RECIPES, "weight", object())  # as if a recipe (with state) were recorded
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = permute_channels(model, ["fc2.weight", "fc3.weight"], 2, 4)
    assert [g.consumers for g in report.groups] == [["fc3.weight"]]
    assert "fc1.weight" in report.skipped["fc2.weight"] and "nmcompile recipe" in report.skipped["fc2.weight"]
    assert torch.equal(model.fc1.weight, state["fc1.weight"])


def test_parameters_stay_the_same_objects():
    model = _randomize_bn(CNN())
    before = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    ptrs = {k: v.data_ptr() for k, v in before.items()}
    for k, p in before.items():
        p.nm_tag = k
    old = model.conv1.weight.detach().clone()
    report = permute_channels(model, ["conv2.weight"], 2, 4)
    assert report.groups and not torch.equal(model.conv1.weight, old)  # something did move
    for k, p in model.named_parameters():
        assert p is before[k] and getattr(p, "nm_tag", None) == k and p.data_ptr() == ptrs[k]
        assert isinstance(p, nn.Parameter) and p.requires_grad
    for k, b in model.named_buffers():
        assert b is buffers[k]
