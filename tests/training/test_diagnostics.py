"""Mask diagnostics recorded through hook_optimizer: flip rate, SAD, and the PNG plot."""

import pytest
import torch
from torch import nn

import nmcompile

import reference


def run(spec, steps=6, every=1, optimizer=torch.optim.SGD):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    nmcompile.annotate(model, spec)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"})
    opt = optimizer(model.parameters(), lr=0.5)
    nmcompile.hook_optimizer(model, opt, diagnostics_every=every)
    masks = [reference.topn_mask(model[0].weight, 2, 4)]
    for _ in range(steps):
        compiled(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        masks.append(reference.topn_mask(model[0].weight, 2, 4))
    return model, masks


def test_flip_rate_and_sad_follow_their_definitions():
    model, masks = run("ste:2:4")
    d = nmcompile.diagnostics(model)["0.weight"]
    # records start after the first optimizer step; each compares with the previous record
    flips = [float((masks[t] ^ masks[t - 1]).float().mean()) for t in range(2, 7)]
    sad = [int((masks[t] ^ masks[1]).sum()) for t in range(2, 7)]
    assert d["flip_rate_steps"].tolist() == [2, 3, 4, 5, 6]
    torch.testing.assert_close(d["flip_rate"], torch.tensor(flips))
    assert d["sad"].tolist() == sad
    assert max(sad) > 0  # lr 0.5 moves masks


def test_every_and_off():
    model, _ = run("ste:2:4", every=2)
    assert nmcompile.diagnostics(model)["0.weight"]["flip_rate_steps"].tolist() == [4, 6]
    model, _ = run("ste:2:4", every=0)
    assert nmcompile.diagnostics(model)["0.weight"] == {}


def test_plot_writes_a_png(tmp_path):
    model, _ = run("step:2:4,total_steps=6,t_max=0.5", steps=6, optimizer=torch.optim.Adam)
    diag = nmcompile.diagnostics(model)
    assert int(diag["0.weight"]["switch_step"]) == 3 and diag["0.weight"]["z"].numel() == 3
    path = nmcompile.training.plot_diagnostics(diag, tmp_path / "masks.png")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.slow  # nine recipes compiled: about 40 s
def test_recording_the_masks_takes_no_graph_break_for_any_recipe():
    from torch._dynamo.utils import counters

    specs = ["ste:2:4", "sr_ste:2:4", "s_ste:2:4", "step:2:4,total_steps=6,t_max=0.5", "mdgf:1:8,total_steps=6",
             "sdgf:1:8,total_steps=6", "bi_mask:2:4", "transposable:2:4", "asp:2:4"]
    for spec in specs:
        torch._dynamo.reset()
        counters.clear()
        model, _ = run(spec, steps=6, optimizer=torch.optim.Adam)
        assert nmcompile.diagnostics(model)["0.weight"]["flip_rate"].numel() == 5, spec
        assert not counters["graph_break"], f"{spec}: {dict(counters['graph_break'])}"
