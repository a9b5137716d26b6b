"""Averaged copies of an annotated model (PyTorch's EMA recipe): masks and step clocks are recipe
state that must be copied, never averaged; ``check`` and ``finalize`` refuse state that was."""

import copy
import re
import warnings

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import nmcompile
from nmcompile.declare.annotate import annotation_of


def trained_with_ema(use_buffers, spec="transposable:2:4,every=1"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    nmcompile.annotate(model, spec)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=use_buffers)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
        ((compiled(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)
    return model, ema


@pytest.mark.filterwarnings("ignore:nmcompile. the recipe state of a copy")
def test_ema_with_averaged_buffers_is_not_ok():
    model, ema = trained_with_ema(use_buffers=True)
    assert int(model[0].weight_nm_step) == 4 and nmcompile.check(model).ok
    mask = ema.module[0].weight_nm_mask
    assert float(mask.float().mean()) < 0.5  # the averaged (rounded down) masks lost entries
    report = nmcompile.check(ema.module)
    assert not report.ok
    assert not report["0.weight"].ok and report["0.weight"].violations == 0  # N:M, but not the recipe's mask
    text = str(report)
    assert "0.weight" in text and "not a transposable 2:4 mask" in text
    assert "AveragedModel" in text and "use_buffers=False" in text
    with pytest.raises(ValueError, match=r"0\.weight: its stored mask is not a transposable 2:4 mask"):
        nmcompile.finalize(ema.module)
    assert annotation_of(ema.module[0], "weight") is not None  # nothing was changed


@pytest.mark.filterwarnings("error:nmcompile. the recipe state of a copy")
def test_ema_without_averaged_buffers_keeps_the_models_masks_and_clock():
    model, ema = trained_with_ema(use_buffers=False)  # the fix the report names
    assert torch.equal(ema.module[0].weight_nm_mask, model[0].weight_nm_mask)
    assert int(ema.module[0].weight_nm_step) == 4
    assert nmcompile.check(ema.module).ok


@pytest.mark.parametrize("spec, found", [("transposable:2:4,every=1", r"its stored mask is not a transposable 2:4 mask"),
                                         ("mdgf:2:4", r"its step clock reads 1 where the model it was copied from reads")])
def test_state_averaged_during_training_is_warned_about_once_and_named_by_check(spec, found):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, ema = trained_with_ema(use_buffers=True, spec=spec)
    averaged = [str(w.message) for w in caught if "recipe state of a copy of the model" in str(w.message)]
    assert len(averaged) == 1, averaged  # once, at the model's step after the first averaging update
    assert re.search(rf"0\.weight \({re.escape(spec)}\): {found}", averaged[0]) and "use_buffers=False" in averaged[0]
    report = nmcompile.check(ema.module)
    assert not report.ok and re.search(found, report["0.weight"].problem)
    assert "AveragedModel" in report["0.weight"].problem
    with pytest.raises(ValueError, match=rf"(?s)none their recipe makes.*0\.weight: {found}"):
        nmcompile.finalize(ema.module)


@pytest.mark.filterwarnings("error:nmcompile. the recipe state of a copy")
def test_a_copy_trained_by_its_own_optimizer_is_not_taken_for_an_average():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    nmcompile.annotate(model, "mdgf:2:4")
    twin = copy.deepcopy(model)
    pairs = [(m, torch.compile(m, backend="nmsparse", options={"inner": "aot_eager"}),
              torch.optim.SGD(m.parameters(), lr=0.1)) for m in (twin, model)]
    x = torch.randn(8, 16)
    for step in range(4):
        for m, compiled, opt in pairs[: 1 if step == 0 else 2]:  # the copy runs one step ahead
            compiled(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert int(twin[0].weight_nm_step) == 4 and int(model[0].weight_nm_step) == 3
    assert "copied from" not in str(nmcompile.check(twin))


@pytest.mark.parametrize("spec", ["asp:2:4", "bi_mask:2:4,every=1,candidates=8", "step:2:4,total_steps=8,t_min=0,t_max=0.25"])
def test_integer_state_averaged_by_the_ema_function_is_not_ok(spec):
    """Each recipe's integer state, averaged as get_ema_multi_avg_fn averages integer buffers
    (``ema * 0.9 + model * 0.1``, rounded toward zero), is named by check."""
    def net(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        nmcompile.annotate(model, spec)
        return model

    ema, model = net(0), net(1)
    if spec.startswith("step"):  # the model has switched (phase 2 from step 2), the average has not
        for layer in (model[0], model[2]):
            layer.weight_nm_phase.fill_(True)
            layer.weight_nm_switch_step.fill_(2)
            layer.weight_nm_step.fill_(2)
    assert nmcompile.check(model).ok or spec.startswith("step")  # (STEP's weights are N:M once it runs)
    average = get_ema_multi_avg_fn(0.9)
    pairs = [(e, m) for e, m in zip(ema.buffers(), model.buffers()) if not torch.is_floating_point(e)]
    average([e for e, _ in pairs], [m for _, m in pairs], None)
    report = nmcompile.check(ema)
    assert not report.ok and "use_buffers=False" in str(report), str(report)
