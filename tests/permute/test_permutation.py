"""Channel permutation for one-shot N:M pruning: the search and its function-preserving use."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nmcompile.masks import keep_mask
from nmcompile.masks import permutation as perm_mod
from nmcompile.masks.permutation import kept_magnitude, search_permutation
from nmcompile.permute.channels import PermutationReport, permute_channels


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
    from nmcompile.state import records

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


# ----------------------------------------------------------------------------------------------
# what the trace does not show: reads elsewhere, hooks, shared memory, reads hidden from tracing


class ReadsProducerWeight(nn.Module):
    """fc1's weight is also used directly: permuting its rows would change the second term."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + F.linear(x, self.fc1.weight)[:, :8]


class ReadsConsumerWeight(MLP):
    def forward(self, x):
        h = self.act(self.fc1(x))
        return self.fc3(F.gelu(self.fc2(h))) + self.fc2.weight[:8, 0]  # reads fc2's channels by index


class ReadsFirstWeight(MLP):
    def forward(self, x):
        return super().forward(x) + F.linear(x, self.fc1.weight)[:, :8]


class SharedWithSide(nn.Module):
    """A second layer holds fc1's weight (tied) and its bias as a view of the same memory."""

    def __init__(self, view: bool):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.side = nn.Linear(16, 32, bias=False)
        self.side.weight = nn.Parameter(self.fc1.weight.detach()[:]) if view else self.fc1.weight

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + self.side(x)[:, :8]


_HIDDEN: dict[str, torch.Tensor] = {}


@torch.fx.wrap
def _hidden_read(x):
    return F.linear(x, _HIDDEN["weight"])[:, :8]


class HiddenRead(ReadsProducerWeight):
    """fc1's weight is read where tracing cannot see it (a wrapped function reading a global)."""

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + _hidden_read(x)


def _order_dependent(module, args, out):
    return out + torch.arange(out.shape[-1], dtype=out.dtype)  # reads the output channels in order


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_left_alone(model, state, x, before):
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    torch.testing.assert_close(model(x), before, atol=0, rtol=0)


@pytest.mark.parametrize("make,names,words,kept", [
    (ReadsProducerWeight, ["fc2.weight"], {"fc2.weight": ["fc1.weight", "read outside", "by linear"]}, []),
    # fc2's weight moves in both groups (columns for fc2, rows for fc3)
    (ReadsConsumerWeight, ["fc2.weight", "fc3.weight"],
     {"fc2.weight": ["'fc2.weight' is also read"], "fc3.weight": ["'fc2.weight' is also read"]}, []),
    # only the first group moves fc1's weight: the second is still permuted
    (ReadsFirstWeight, ["fc2.weight", "fc3.weight"], {"fc2.weight": ["'fc1.weight' is also read"]}, ["fc3.weight"]),
    (lambda: SharedWithSide(view=False), ["fc2.weight"], {"fc2.weight": ["fc1.weight", "side.weight"]}, []),
    (lambda: SharedWithSide(view=True), ["fc2.weight"], {"fc2.weight": ["fc1.weight", "side.weight", "memory"]}, []),
], ids=["producer_weight_read", "consumer_weight_read", "one_of_two_groups", "tied", "view"])
def test_tensors_used_elsewhere_are_not_moved(make, names, words, kept):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(5, 16)
    before, state = model(x), _state(model)
    report = permute_channels(model, names, 2, 4)
    assert set(report.skipped) == set(words)
    for name, expected in words.items():
        for word in expected:
            assert word in report.skipped[name], report.skipped[name]
    assert [c for g in report.groups for c in g.consumers] == kept
    if kept:
        assert not torch.equal(model.fc2.weight, state["fc2.weight"])  # the kept group did move
        torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)
    else:
        _assert_left_alone(model, state, x, before)


@pytest.mark.parametrize("where", ["producer", "consumer_pre", "relu", "outer", "grad"])
def test_hooks_that_would_see_permuted_channels_refuse_the_group(where):
    torch.manual_seed(0)
    seen = []
    model = MLP()
    if where == "producer":
        model.fc1.register_forward_hook(_order_dependent)
    elif where == "consumer_pre":
        model.fc2.register_forward_pre_hook(lambda mod, args: (args[0] * torch.linspace(0, 1, 64),))
    elif where == "relu":
        model.act.register_forward_hook(_order_dependent)
    elif where == "grad":
        model.fc1.weight.register_hook(lambda g: g)
    else:  # a container holding the producer but not the consumer: the permuted tensor crosses it
        model.fc1 = nn.Sequential(model.fc1)
        model.fc1.register_forward_hook(lambda mod, args, out: seen.append(out))  # adds no traced op
    x = torch.randn(5, 16)
    before, state = model(x), _state(model)
    report = permute_channels(model, ["fc2.weight"], 2, 4)
    assert report.groups == []
    word = {"producer": "forward hook", "consumer_pre": "forward pre-hook", "relu": "'act' has a forward hook",
            "outer": "holds 'fc1.0'", "grad": "gradient hook"}[where]
    assert word in report.skipped["fc2.weight"], report.skipped["fc2.weight"]
    _assert_left_alone(model, state, x, before)


def test_global_module_hooks_refuse_everything():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 16)
    before, state = model(x), _state(model)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
    try:
        report = permute_channels(model, ["fc2.weight", "fc3.weight"], 2, 4)
    finally:
        handle.remove()
    assert report.groups == [] and set(report.skipped) == {"fc2.weight", "fc3.weight"}
    assert all("global module forward hook" in why for why in report.skipped.values())
    _assert_left_alone(model, state, x, before)


def test_a_read_hidden_from_tracing_is_caught_by_the_check_and_undone():
    torch.manual_seed(0)
    model = HiddenRead()
    _HIDDEN["weight"] = model.fc1.weight
    x = torch.randn(5, 16)
    before, state = model(x), _state(model)
    report = permute_channels(model, ["fc2.weight"], 2, 4)
    why = report.skipped["fc2.weight"]
    assert "changed the whole model on derived inputs of shape (2, 16)" in why and "left unpermuted" in why, why
    assert "'fc1' > fc2" in why
    _assert_left_alone(model, state, x, before)


class LinearBN3d(nn.Module):
    """BatchNorm1d after a Linear on 3-D input normalizes the tokens, not the Linear's features."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.bn(self.fc1(x)))


def test_batchnorm_after_linear_needs_example_inputs_and_is_checked_on_them():
    torch.manual_seed(0)
    model = _randomize_bn(LinearBN3d())
    x3 = torch.randn(2, 32, 16)  # 32 tokens: BatchNorm1d(32) runs, over the wrong dim
    before, state = model(x3), _state(model)
    report = permute_channels(model, ["fc2.weight"], 2, 4)
    assert "only for 2-D inputs" in report.skipped["fc2.weight"]
    _assert_left_alone(model, state, x3, before)

    report = permute_channels(model, ["fc2.weight"], 2, 4, example_inputs=(x3,))
    assert "changed the whole model on example_inputs" in report.skipped["fc2.weight"]
    _assert_left_alone(model, state, x3, before)

    x2 = torch.randn(6, 16)  # on 2-D inputs the same permutation is right, and kept
    before2 = model(x2)
    report = permute_channels(model, ["fc2.weight"], 2, 4, example_inputs=x2)
    assert [g.batchnorms for g in report.groups] == [["bn"]] and report.checked == "the whole model on example_inputs"
    assert not torch.equal(model.fc1.weight, state["fc1.weight"])
    torch.testing.assert_close(model(x2), before2, atol=1e-5, rtol=1e-5)


def test_example_inputs_that_do_not_run_are_an_error():
    with pytest.raises(ValueError, match="failed on example_inputs"):
        permute_channels(MLP(), ["fc2.weight"], 2, 4, example_inputs=torch.randn(3, 5))


class ProducerTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.fc1(x)))))


class TwoInputs(nn.Module):
    """Inputs that cannot be derived (the second enters an add): each group runs on its own."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 8, 1)

    def forward(self, x, y):
        return self.conv2(F.relu(self.conv1(x))) + y


def test_producer_called_twice_is_refused():
    torch.manual_seed(0)
    model = ProducerTwice()
    x = torch.randn(5, 32)
    before, state = model(x), _state(model)
    report = permute_channels(model, ["fc2.weight"], 2, 4)
    assert "called more than once" in report.skipped["fc2.weight"]
    _assert_left_alone(model, state, x, before)


def test_without_derivable_inputs_each_group_is_checked_on_its_layers():
    torch.manual_seed(0)
    model = TwoInputs()
    x, y = torch.randn(2, 3, 6, 6), torch.randn(2, 8, 6, 6)
    before = model(x, y)
    report = permute_channels(model, ["conv2.weight"], 2, 4)
    assert report.checked == "each group's layers on an input for its producer"
    assert [g.producer for g in report.groups] == ["conv1"]
    torch.testing.assert_close(model(x, y), before, atol=1e-5, rtol=1e-5)
    assert "function checked on each group's layers" in str(report)


def test_the_check_leaves_no_trace_on_the_model():
    model = _randomize_bn(CNN()).train()
    model.bn.momentum = 0.5  # a forward in training mode would move the running statistics
    rng = torch.get_rng_state()
    report = permute_channels(model, ["conv3.weight"], 2, 4)
    assert report.checked.startswith("the whole model on derived inputs") and report.groups
    assert model.training and model.bn.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert int(model.bn.num_batches_tracked) == 0
