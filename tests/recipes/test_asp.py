"""ASP: one-shot prune with a fixed mask, and the function-preserving channel permutation."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile

import reference


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def test_permutation_keeps_the_dense_function_and_raises_kept_magnitude():
    model = mlp()
    x = torch.randn(16, 32)
    before = model(x)
    unpermuted = {n: reference.topn_mask(p, 2, 4).mul(p).abs().sum() for n, p in model.named_parameters() if p.dim() == 2}
    report = nmcompile.annotate(model, "asp:2:4")
    perm_report = report.prepared["asp:2:4"]
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)  # same dense function
    assert {n for g in perm_report.groups for n in g.consumers} == {"2.weight", "4.weight"}
    assert "0.weight" in perm_report.skipped  # its input is the model input
    assert perm_report.total_gain > 0
    for name in ("2.weight", "4.weight"):
        p = model.get_parameter(name)
        assert (p * getattr(model.get_submodule(name[0]), "weight_nm_mask")).abs().sum() > unpermuted[name]
    assert str(perm_report)


@pytest.mark.slow
def test_mask_never_changes_and_pruned_weights_get_no_update():
    model = mlp()
    nmcompile.annotate(model, "asp:2:4,permute=false")
    masks = {n: b.clone() for n, b in model.named_buffers() if n.endswith("_nm_mask")}
    pruned_before = {n: p[~model.get_buffer(n + "_nm_mask").bool()].clone() for n, p in model.named_parameters() if p.dim() == 2}
    compiled = torch.compile(model, backend="nmsparse")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0)
    nmcompile.hook_optimizer(model, opt, diagnostics_every=1)
    x, y = torch.randn(64, 32), torch.randn(64, 8)
    losses = []
    for _ in range(15):
        loss = F.mse_loss(compiled(x), y)
        loss.backward()
        for n, p in model.named_parameters():
            if p.dim() == 2:
                assert not p.grad[~model.get_buffer(n + "_nm_mask").bool()].any()  # masked gradient
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    for n, b in model.named_buffers():
        if n in masks:
            assert torch.equal(b, masks[n])
    for n, p in model.named_parameters():
        if p.dim() == 2:
            assert torch.equal(p[~model.get_buffer(n + "_nm_mask").bool()], pruned_before[n])
    assert nmcompile.check(model).ok
    flips = nmcompile.diagnostics(model)["0.weight"]["flip_rate"]
    assert flips.numel() == 14 and not flips.any()


def test_permutation_through_the_backend_route_is_reported(recwarn):
    model = mlp()
    compiled = torch.compile(model, backend="nmsparse", options={"recipe": "asp:2:4", "inner": "aot_eager"})
    compiled(torch.randn(4, 32))
    assert any("channel permutation" in str(w.message) for w in recwarn)


class UsesFc1Twice(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        if how == "shared":
            self.side = nn.Linear(32, 64)
            self.side.weight = self.fc1.weight  # one parameter, two modules
        if how == "hook":
            self.fc1.register_forward_hook(lambda mod, args, out: out * torch.linspace(0.5, 1.5, out.shape[-1]))

    def forward(self, x):
        y = self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))
        if self.how == "read":
            y = y + F.linear(x, self.fc1.weight)[:, :8]
        elif self.how == "shared":
            y = y + self.side(x)[:, :8]
        return y


def test_annotate_refuses_permutations_that_would_change_the_function_and_says_why():
    words = {"read": "'fc1.weight' is also read", "hook": "'fc1' has a forward hook", "shared": "side.weight"}
    x = torch.randn(16, 32)
    for how, word in words.items():
        model = UsesFc1Twice(how)
        before, fc1 = model(x), model.fc1.weight.detach().clone()
        report = nmcompile.annotate(model, "asp:2:4").prepared["asp:2:4"]
        torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)  # the dense function
        assert torch.equal(model.fc1.weight, fc1), how
        assert word in report.skipped["fc2.weight"], (how, report.skipped)
        assert "fc2.weight" in str(report)
        # fc2 -> fc3 moves none of fc1's tensors: still permuted, and checked on the whole model
        assert [g.consumers for g in report.groups] == [["fc3.weight"]], how
        assert report.checked == "the whole model on derived inputs of shape (2, 32)"


def test_annotate_still_permutes_the_plain_mlp_and_checks_it():
    model = mlp()
    x = torch.randn(16, 32)
    before = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = nmcompile.annotate(model, "asp:2:4").prepared["asp:2:4"]
    assert [g.producer for g in report.groups] == ["0", "2"]
    assert report.checked == "the whole model on derived inputs of shape (2, 32)"
    assert "function checked on the whole model" in str(report)
    assert not torch.equal(model.get_parameter("2.weight"), state["2.weight"])
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)
