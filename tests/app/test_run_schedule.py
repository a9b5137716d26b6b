"""train_run's learning-rate schedules (lr_at) and the validation of its options."""

import math

import pytest
import torch

from nmcompile.app.run import lr_at, train_run


def test_constant_keeps_the_rate():
    assert [lr_at(s, 100, 3e-3) for s in (0, 50, 99)] == [3e-3] * 3


def test_cosine_warms_up_linearly_then_decays_along_half_a_cosine():
    steps, lr = 200, 1e-2  # warmup 0.05: w = 10 steps
    assert lr_at(0, steps, lr, "cosine") == pytest.approx(lr / 10)
    assert lr_at(4, steps, lr, "cosine") == pytest.approx(lr * 5 / 10)
    assert lr_at(9, steps, lr, "cosine") == pytest.approx(lr)  # the last warmup step reaches the peak
    assert lr_at(10, steps, lr, "cosine") == pytest.approx(lr)  # the decay starts at the peak
    assert lr_at(105, steps, lr, "cosine") == pytest.approx(lr / 2)  # halfway through the decay
    assert lr_at(57, steps, lr, "cosine") == pytest.approx(lr * (1 + math.cos(math.pi * 47 / 190)) / 2)
    assert 0 < lr_at(199, steps, lr, "cosine") < lr * 1e-3  # towards 0 at the end
    rates = [lr_at(s, steps, lr, "cosine") for s in range(10, steps)]
    assert all(a > b for a, b in zip(rates, rates[1:]))  # decreasing after the warmup
    assert lr_at(0, steps, lr, "cosine", warmup=0.0) == pytest.approx(lr)  # no warmup


def test_train_run_sets_the_scheduled_rate_on_the_optimizer(monkeypatch):
    seen = []
    step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    model = torch.nn.Linear(4, 2)
    data = (torch.randn(8, 4), torch.randn(8, 2))
    out = train_run(model, None, lambda s: data, torch.nn.functional.mse_loss, lambda f: 0.0, steps=20, lr=1.0,
                    schedule="cosine", warmup=0.25, progress=False, inner="eager")
    assert seen == pytest.approx([lr_at(s, 20, 1.0, "cosine", 0.25) for s in range(20)])
    assert out["record"]["schedule"] == "cosine" and out["record"]["warmup"] == 0.25


@pytest.mark.parametrize("kwargs, message", [({"schedule": "linear"}, "schedule must be one of constant, cosine"),
                                             ({"schedule": "cosine", "warmup": 1.0}, "warmup is a fraction")])
def test_train_run_rejects_a_bad_schedule_before_training(kwargs, message):
    with pytest.raises(ValueError, match=message):
        train_run(torch.nn.Linear(4, 2), None, None, None, None, steps=10, progress=False, **kwargs)
