"""One-shot recipes through the graph: calibration statistics gathered by nmsparse::accumulate_stats.

Every declaration route, every GEMM form (linear, GPT-2 Conv1D, x @ W, conv1d/conv2d, MoE experts
with routed tokens): the statistics equal those of the inputs computed by hand, and finalize solves
each weight as the references of tests/reference.py do on those inputs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile
from nmcompile.masks.calibration import ALL_EXPERTS, input_rows, to_columns

import reference as ref
from models import AOT, declare

E = 4

pytestmark = pytest.mark.filterwarnings("ignore:nmsparse. recipe state for")


class Net(nn.Module):
    def __init__(self, region=None):
        super().__init__()
        self.region = region
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def body(self, x):
        h1 = F.relu(self.fc1(x))
        h2 = F.relu(self.fc2(h1))
        return self.fc3(h2), (x, h1, h2)

    def forward(self, x):
        if self.region is None:
            return self.body(x)[0]
        with nmcompile.region(self.region):
            return self.body(x)[0]


def run(compiled, batches):
    with torch.no_grad():
        for x in batches:
            compiled(x)


def compile_quietly(model, options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # recipe state created at the first forward
        return torch.compile(model, backend="nmsparse", options=options)


@pytest.mark.parametrize("route", ["annotate", "options", "env", "region"])
@pytest.mark.parametrize("recipe", ["wanda:2:4", "sparsegpt:2:4,blocksize=8"])
def test_every_route_calibrates_in_the_graph_and_finalize_solves_as_the_reference(route, recipe, monkeypatch):
    model = Net(region=recipe if route == "region" else None).eval()
    if route == "region":
        options = dict(AOT)
    else:
        _, options = declare(model, recipe, route, monkeypatch)
    batches = [torch.randn(3, 5, 16) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(torch.compile(model, backend="nmsparse", options=options), batches)
    with torch.no_grad():
        inputs = [torch.cat([model.body(x)[1][i].reshape(-1, d) for x in batches]) for i, d in enumerate((16, 32, 32))]
    gram = recipe.startswith("sparsegpt")
    dense = {name: layer.weight.detach().clone() for name, layer in (("fc1", model.fc1), ("fc2", model.fc2),
                                                                      ("fc3", model.fc3))}
    for (name, layer), x in zip((("fc1", model.fc1), ("fc2", model.fc2), ("fc3", model.fc3)), inputs):
        stat = getattr(layer, "weight_nm_xtx" if gram else "weight_nm_sq")
        assert int(layer.weight_nm_count) == 60
        torch.testing.assert_close(stat, x.T @ x if gram else x.square().sum(0), rtol=1e-5, atol=1e-4)
    report = nmcompile.finalize(model)
    assert set(report) == {"fc1.weight", "fc2.weight", "fc3.weight"} and not report.fallbacks
    for (name, layer), x in zip((("fc1", model.fc1), ("fc2", model.fc2), ("fc3", model.fc3)), inputs):
        want = ref.sparsegpt(dense[name], x, 2, 4)[0] if gram else ref.wanda(dense[name], x, 2, 4)
        torch.testing.assert_close(layer.weight.detach(), want, rtol=1e-4, atol=1e-4)
    assert nmcompile.check(model).ok
    assert not any(k.endswith(("_nm_xtx", "_nm_sq", "_nm_count")) for k in model.state_dict())


def test_statistics_count_every_forward_also_in_train_mode_with_grad():
    model = Net()
    compiled = compile_quietly(model, {**AOT, "recipe": "wanda:2:4"})
    x = torch.randn(6, 16)
    compiled(x).sum().backward()  # a training-mode forward counts too (and trains nothing: dense)
    run(compiled, [x])
    assert int(model.fc1.weight_nm_count) == 12
    torch.testing.assert_close(model.fc1.weight_nm_sq, 2 * x.square().sum(0))


# ---------------------------------------------------------------------------------------------
# layouts: the rows input_rows gives, times the weight's columns, are the GEMM's output
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("conv", ["conv1d", "conv2d"])
def test_conv_patches_times_columns_is_the_convolution(conv):
    if conv == "conv2d":
        x, w, args = torch.randn(2, 8, 7, 6), torch.randn(5, 8, 3, 2), dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2))
        out = F.conv2d(x, w, **args)
        spec = [3, 2, 2, 1, 1, 0, 1, 2]
    else:
        x, w, args = torch.randn(2, 8, 9), torch.randn(5, 8, 3), dict(stride=2, padding=1, dilation=2)
        out = F.conv1d(x, w, **args)
        spec = [3, 2, 1, 2]
    rows, who = input_rows(x, "conv", None, spec)
    assert who is None
    torch.testing.assert_close(rows @ to_columns(w, 1).T, out.movedim(1, -1).reshape(-1, 5), rtol=1e-4, atol=1e-4)


def test_expert_layouts_route_each_row_to_its_expert():
    w = torch.randn(E, 8, 6)  # [E, in, out]
    x = torch.randn(E, 3, 8)
    rows, who = input_rows(x, "batched", None, [])
    assert torch.equal(who, torch.arange(E).repeat_interleave(3))
    torch.testing.assert_close(torch.stack([rows[who == e] @ w[e] for e in range(E)]), x @ w)
    rows, who = input_rows(torch.randn(5, 8), "batched", None, [])
    assert who == ALL_EXPERTS
    offs = torch.tensor([2, 5, 5, 8])
    rows, who = input_rows(torch.randn(9, 8), "grouped", offs, [])
    assert who.tolist() == [0, 0, 1, 1, 1, 3, 3, 3, -1]  # expert 2 gets none; a row past the last end, none
    ids = torch.tensor([0, 3, 3, 1])
    rows, who = input_rows(torch.randn(4, 1, 8), "gathered", ids, [])
    assert torch.equal(who, ids)


# ---------------------------------------------------------------------------------------------
# GEMM forms in the graph
# ---------------------------------------------------------------------------------------------


class Forms(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        if form == "conv1d_gpt2":
            transformers = pytest.importorskip("transformers")
            self.layer = transformers.pytorch_utils.Conv1D(6, 8)  # weight [in 8, out 6]
        elif form == "x @ W":
            self.weight = nn.Parameter(torch.randn(8, 6))
        elif form == "conv2d":
            self.layer = nn.Conv2d(8, 4, 3, padding=1, stride=2)
        elif form == "conv1d":
            self.layer = nn.Conv1d(8, 4, 3, dilation=2)

    def forward(self, x):
        return x @ self.weight if self.form == "x @ W" else self.layer(x)


FORM_INPUTS = {"conv1d_gpt2": (2, 5, 8), "x @ W": (2, 5, 8), "conv2d": (2, 8, 6, 6), "conv1d": (2, 8, 9)}


@pytest.mark.parametrize("form", list(FORM_INPUTS))
def test_layer_forms_gather_their_inputs(form):
    model = Forms(form).eval()
    name = "weight" if form == "x @ W" else "layer.weight"
    compiled = compile_quietly(model, {**AOT, "recipe": "sparsegpt:2:4,blocksize=8"})
    batches = [torch.randn(FORM_INPUTS[form]) for _ in range(2)]
    run(compiled, batches)
    holder = model if form == "x @ W" else model.layer
    weight = holder.weight.detach().clone()
    dim = 0 if form in ("x @ W", "conv1d_gpt2") else 1
    columns = to_columns(weight, dim)
    if form.startswith("conv") and form != "conv1d_gpt2":
        layer = model.layer
        spec = [*layer.kernel_size, *layer.stride, *layer.padding, *layer.dilation]
        x = torch.cat([input_rows(b, "conv", None, spec)[0] for b in batches])
    else:
        x = torch.cat([b.reshape(-1, 8) for b in batches])
    assert int(holder.weight_nm_count) == x.shape[0]
    torch.testing.assert_close(holder.weight_nm_xtx, x.T @ x, rtol=1e-5, atol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few tokens for the width: named in the report
        report = nmcompile.finalize(model)
    assert report[name].dim == dim
    want = ref.sparsegpt(columns, x, 2, 4)[0]
    torch.testing.assert_close(to_columns(holder.weight.detach(), dim), want, rtol=1e-4, atol=1e-4)
    assert nmcompile.check(model).ok


class Experts(nn.Module):
    """``weight`` [E, A, B] used by one expert GEMM form (as in tests/backends/test_moe.py)."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.weight = nn.Parameter(torch.randn(E, 8, 8))

    def forward(self, x):
        w = self.weight
        if self.form == "x @ W":
            return x @ w
        if self.form == "bmm(W, x)":
            return torch.bmm(w, x)
        if self.form == "grouped_mm":
            return torch._grouped_mm(x, w, offs=torch.tensor([2, 5, 5, 8], dtype=torch.int32))
        if self.form == "linear(x, W[e])":
            return torch.stack([F.linear(x[e], w[e]) for e in range(E) if e != 2])  # expert 2 unused
        if self.form == "bmm(x, W[ids])":
            ids = torch.tensor([0, 3, 3, 1, 0, 0])
            return torch.bmm(x.unsqueeze(1), w[ids]).squeeze(1)
        raise AssertionError(self.form)


def expert_rows(form, x):
    """{expert: the rows that reach it}, by hand (columns: each expert's reduction axis)."""
    if form == "x @ W":
        return {e: x[e] for e in range(E)}
    if form == "bmm(W, x)":
        return {e: x[e].T for e in range(E)}
    if form == "grouped_mm":
        return {0: x[0:2], 1: x[2:5], 3: x[5:8]}
    if form == "linear(x, W[e])":
        return {e: x[e] for e in range(E) if e != 2}
    ids = [0, 3, 3, 1, 0, 0]
    return {e: x[[i for i, k in enumerate(ids) if k == e]] for e in (0, 1, 3)}


EXPERT_FORMS = {"x @ W": ((E, 3, 8), -2), "bmm(W, x)": ((E, 8, 3), -1), "grouped_mm": ((8, 8), -2),
                "linear(x, W[e])": ((E, 3, 8), -1), "bmm(x, W[ids])": ((6, 8), -2)}


@pytest.mark.parametrize("form", list(EXPERT_FORMS))
def test_each_expert_counts_only_the_tokens_routed_to_it(form):
    shape, dim = EXPERT_FORMS[form]
    dtype = torch.bfloat16 if form == "grouped_mm" else torch.float32
    model = Experts(form).to(dtype).eval()
    compiled = compile_quietly(model, {**AOT, "recipe": "sparsegpt:2:4,blocksize=8"})
    x = torch.randn(shape, dtype=dtype)
    run(compiled, [x, x])
    rows = {e: r.float() for e, r in expert_rows(form, x).items()}
    counts = [2 * rows[e].shape[0] if e in rows else 0 for e in range(E)]
    assert model.weight_nm_count.tolist() == counts
    for e in range(E):
        want = 2 * rows[e].T @ rows[e] if e in rows else torch.zeros(8, 8)
        torch.testing.assert_close(model.weight_nm_xtx[e], want, rtol=1e-5, atol=1e-4)
    w = model.weight.detach().float().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = nmcompile.finalize(model)
    unused = [e for e in range(E) if e not in rows]
    notes = report.fallbacks.get("weight", [])
    assert [n for n in notes if "pruned by magnitude" in n] == [
        n for n in notes if any(f"weight[expert {e}]: no calibration token" in n for e in unused)]
    assert len([n for n in notes if "pruned by magnitude" in n]) == len(unused)
    if unused:
        assert any("no calibration token reached it" in str(c.message) for c in caught)
    solved = to_columns(model.weight.detach().float(), dim)
    for e in range(E):
        we = to_columns(w, dim)[e]
        want = ref.sparsegpt(we, torch.cat([rows[e]] * 2), 2, 4)[0] if e in rows else nmcompile.masks.prune(we, 2, 4, 1)
        torch.testing.assert_close(solved[e], want.to(dtype).float(), rtol=2e-2, atol=2e-2)
    assert nmcompile.check(model).ok


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_tiny_mixtral_experts_count_the_tokens_their_router_sends(implementation):
    from test_moe import EXPERT_WEIGHTS, tiny_mixtral

    model = tiny_mixtral(implementation).eval()
    nmcompile.annotate(model, "sparsegpt:2:4,blocksize=16")
    experts = model.model.layers[0].mlp.experts
    seen = {}
    handle = experts.register_forward_hook(lambda mod, args, out: seen.update(x=args[0], ids=args[1]))
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        model(ids)  # eager, for the reference routing (the statistics gather only in the graph)
    handle.remove()
    assert int(experts.gate_up_proj_nm_count.sum()) == 0
    compiled = compile_quietly(model, {**AOT})
    run(compiled, [ids])
    routed = torch.bincount(seen["ids"].flatten(), minlength=E)
    assert experts.gate_up_proj_nm_count.tolist() == routed.tolist()
    assert experts.down_proj_nm_count.tolist() == routed.tolist()
    for e in range(E):
        x = seen["x"][(seen["ids"] == e).any(-1)]
        torch.testing.assert_close(experts.gate_up_proj_nm_xtx[e], x.T @ x, rtol=1e-5, atol=1e-4)
    report = nmcompile.finalize(model)
    assert all(name in report for name in EXPERT_WEIGHTS)
    assert nmcompile.check(model).ok


@pytest.mark.inductor
@pytest.mark.slow
def test_statistics_gather_under_inductor():
    """The default inner compiler: the op's buffer mutation survives Inductor's functionalization."""
    model = Net().eval()
    compiled = compile_quietly(model, {"recipe": "sparsegpt:2:4"})
    batches = [torch.randn(7, 16) for _ in range(3)]
    run(compiled, batches)
    x = torch.cat(batches)
    assert int(model.fc1.weight_nm_count) == 21
    torch.testing.assert_close(model.fc1.weight_nm_xtx, x.T @ x, rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        h = F.relu(model.fc1(x))
    torch.testing.assert_close(model.fc2.weight_nm_xtx, h.T @ h, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout, x, stat, count, route, gram", [
    ("rows", torch.randn(2, 3, 8), torch.zeros(8, 8), torch.zeros((), dtype=torch.int64), None, True),
    ("rows", torch.randn(5, 8), torch.zeros(8), torch.zeros((), dtype=torch.int64), None, False),
    ("grouped", torch.randn(8, 8), torch.zeros(E, 8, 8), torch.zeros(E, dtype=torch.int64), torch.tensor([2, 5, 5, 8]),
     True),
])
def test_accumulate_stats_passes_opcheck(layout, x, stat, count, route, gram):
    from nmcompile import ops

    torch.library.opcheck(ops.accumulate_stats, (x, stat.clone(), count.clone(), route, layout, -1, [], gram))
    ops.accumulate_stats(x, stat, count, route, layout, -1, [], gram)
    rows = x.reshape(-1, 8)
    if layout == "rows":
        assert int(count) == rows.shape[0]
        torch.testing.assert_close(stat, rows.T @ rows if gram else rows.square().sum(0))
    else:
        assert count.tolist() == [2, 3, 0, 3]
        torch.testing.assert_close(stat[1], rows[2:5].T @ rows[2:5])
