"""A declared weight that the compiled graph leaves dense (einsum, ``x @ W.t()``, two reduction dims, a
conv whose recipe's backward cannot be rewritten) trains dense: ``check``, ``effective_weights`` and
``finalize`` say so, and ``finalize`` never bakes the recipe's weight as if it had trained with it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile
from nmcompile import masks

AOT = {"inner": "aot_eager"}


class Uses(nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.fc, self.conv = kind, nn.Linear(16, 16), nn.Conv2d(8, 8, 3)

    def forward(self, x):
        if self.kind == "einsum":
            return torch.einsum("bi,oi->bo", x, self.fc.weight)
        if self.kind == "x @ W.t()":
            return x @ self.fc.weight.t()
        if self.kind == "two reduction dims":
            return x @ self.fc.weight + F.linear(x, self.fc.weight)
        return self.conv(x)  # an unbatched input: the MVUE backward is not rewritten for it


CASES = {
    "einsum": ("fc.weight", "sr_ste:2:4", r"used only by call_function einsum"),
    "x @ W.t()": ("fc.weight", "sr_ste:2:4", r"used only by call_method t"),
    "two reduction dims": ("fc.weight", "s_ste:2:4", r"used with two different reduction dimensions"),
    "conv": ("conv.weight", "sr_ste:2:4,wgrad=mvue24", r"changes the GEMM's backward"),
}


def trained(kind):
    name, recipe, why = CASES[kind]
    model = Uses(kind)
    nmcompile.annotate(model, {name: recipe})
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(8, 6, 6) if kind == "conv" else torch.randn(4, 16)
    with pytest.warns(UserWarning, match="nmsparse left these weights dense"):
        compiled(x).square().mean().backward()
    opt.step()
    return model, name, why


@pytest.mark.parametrize("kind", list(CASES))
def test_check_and_effective_weights_name_a_weight_the_graph_left_dense(kind):
    model, name, why = trained(kind)
    report = nmcompile.check(model)
    assert not report.ok
    assert "the nmsparse graph left it dense, so it trains dense" in report[name].problem
    assert why in report[name].problem.replace("\n", " ")
    dense = model.get_parameter(name).detach()
    assert torch.equal(nmcompile.effective_weights(model)[name], dense)  # what the graph's forward uses


@pytest.mark.parametrize("kind", list(CASES))
def test_finalize_refuses_a_weight_the_graph_left_dense_and_force_records_it_as_trained_dense(kind):
    model, name, why = trained(kind)
    before = model.get_parameter(name).detach().clone()
    with pytest.raises(ValueError, match=rf"(?s)left these declared weights dense.*{name}.*{why}.*force=True"):
        nmcompile.finalize(model)
    assert torch.equal(model.get_parameter(name), before)  # nothing was changed
    with pytest.warns(UserWarning, match=r"force=True.*trained dense"):
        report = nmcompile.finalize(model, force=True)
    assert report[name].recipe == "" and why in report[name].trained_dense
    text = str(report)
    assert "trained dense, pruned by magnitude at finalize" in text and "trained with" not in text
    assert torch.equal(model.get_parameter(name), masks.prune(before, 2, 4, 1))
    assert nmcompile.check(model).ok


def test_a_weight_a_graph_rewrote_is_not_named_left_dense():
    class Linear(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x)

    model = Linear()
    nmcompile.annotate(model, "sr_ste:2:4")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to name
        compiled(torch.randn(4, 16)).sum().backward()
    assert nmcompile.check(model).ok
    nmcompile.finalize(model)
