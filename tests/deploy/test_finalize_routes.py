"""finalize(calibration=...) for a one-shot recipe declared through compile options, NMSPARSE_RECIPE or
a region, which exists only once a compiled forward has run: the calibration's first run declares it.
A second finalize(calibration=...) is idempotent."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nmcompile

from models import AOT

pytestmark = pytest.mark.filterwarnings("ignore:nmsparse. recipe state for")

RECIPE = "wanda:2:4"


class Stack(nn.Module):
    def __init__(self, region=None):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.region = region

    def forward(self, x):
        for layer in self.layers:
            if self.region is None:
                x = torch.tanh(layer(x))
            else:
                with nmcompile.region(self.region):
                    x = torch.tanh(layer(x))
        return x


def data():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(24, 16, generator=g) for _ in range(2)]


def declared(route, monkeypatch):
    """The model and its compiled form, declared through ``route`` (nothing has run yet)."""
    model = Stack(region=RECIPE if route == "region" else None).eval()
    options = dict(AOT)
    if route == "options":
        options["recipe"] = RECIPE
    elif route == "NMSPARSE_RECIPE":
        monkeypatch.setenv("NMSPARSE_RECIPE", RECIPE)
    elif route == "annotate":
        nmcompile.annotate(model, RECIPE)
    return model, torch.compile(model, backend="nmsparse", options=options)


def by_annotate(sequential):
    model = Stack().eval()
    nmcompile.annotate(model, RECIPE)
    nmcompile.finalize(model, calibration=data(), sequential=sequential, calibration_options=AOT)
    return model


@pytest.mark.parametrize("sequential", [False, True], ids=["one pass", "sequential"])
@pytest.mark.parametrize("route", ["options", "NMSPARSE_RECIPE", "region"])
def test_a_recipe_declared_at_the_first_forward_is_calibrated_by_finalize(route, sequential, monkeypatch):
    model, compiled = declared(route, monkeypatch)
    calls = []

    def calibration():
        calls.append(1)
        with torch.no_grad():
            for x in data():
                compiled(x)

    report = nmcompile.finalize(model, calibration=calibration, sequential=sequential)
    assert sorted(report) == ["layers.0.weight", "layers.1.weight", "layers.2.weight"]
    assert "declared at the calibration's first compiled forward" in report.calibration
    if not sequential:
        assert len(calls) == 1  # the run that declared the recipe gathered the statistics
    want = by_annotate(sequential)
    for (name, a), b in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert nmcompile.check(model).ok


def test_batches_with_a_recipe_from_the_environment_or_finalizes_own_options(monkeypatch):
    monkeypatch.setenv("NMSPARSE_RECIPE", RECIPE)
    model = Stack().eval()
    nmcompile.finalize(model, calibration=data(), calibration_options=AOT)
    monkeypatch.delenv("NMSPARSE_RECIPE")
    other = Stack().eval()
    nmcompile.finalize(other, calibration=data(), calibration_options={**AOT, "recipe": RECIPE})
    want = by_annotate(False)
    for a, b, c in zip(model.parameters(), other.parameters(), want.parameters()):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)


def test_batches_cannot_see_the_options_of_the_users_own_compile_and_say_so(monkeypatch):
    model, _ = declared("options", monkeypatch)
    dense = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"no weight of Stack is declared with a one-shot recipe.*"
                                         r"calibration_options=\{'recipe': 'sparsegpt:2:4'\}"):
        nmcompile.finalize(model, calibration=data(), calibration_options=AOT)
    for key, value in model.state_dict().items():
        assert torch.equal(value, dense[key]), key


def test_a_function_that_runs_no_nmsparse_graph_is_named():
    model = Stack().eval()
    with pytest.raises(ValueError, match=r"calibration\(\) ran, and no weight got a one-shot recipe"):
        nmcompile.finalize(model, calibration=lambda: model(torch.randn(4, 16)))


@pytest.mark.parametrize("route", ["options", "annotate"])
def test_a_second_finalize_with_calibration_changes_nothing_and_returns_the_same_report(route, monkeypatch):
    model, compiled = declared(route, monkeypatch)
    calls = []

    def calibration():
        calls.append(1)
        with torch.no_grad():
            for x in data():
                compiled(x)

    first = nmcompile.finalize(model, calibration=calibration)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ran = len(calls)
    with pytest.warns(UserWarning, match="already finalized.*the calibration was not run"):
        second = nmcompile.finalize(model, calibration=calibration)
    assert len(calls) == ran and dict(second) == dict(first)
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
