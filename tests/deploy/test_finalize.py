"""finalize: the trained function kept in plain parameters, state dropped, idempotent, loadable without nmcompile."""

import io
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import nmcompile
import reference
from models import AOT, CNN, MLP, _fresh_counters, nm_violations, train  # noqa: F401
from models import SCHEDULED

RECIPES = {"ste": "ste:2:4", "sr_ste": "sr_ste:2:4", "s_ste": "s_ste:2:4", **SCHEDULED}


def _trained_mlp(spec):
    model = MLP()
    nmcompile.annotate(model, spec)
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    x, y = torch.randn(16, 16), torch.randn(16, 8)
    train(model, compiled, (x,), loss_fn=lambda out: F.mse_loss(out, y), lr=3e-3)
    return model, compiled, x


@pytest.mark.parametrize("key", RECIPES)
def test_finalized_model_computes_the_trained_function(key):
    model, compiled, x = _trained_mlp(RECIPES[key])
    model.eval()
    with torch.no_grad():
        trained = compiled(x)  # the backend's eval forward with the recipe's effective weights
        effective = nmcompile.effective_weights(model)
    report = nmcompile.finalize(model)
    assert set(report) == {"fc1.weight", "fc2.weight", "fc3.weight"}
    for name, param in model.named_parameters():
        if name in effective:
            assert torch.equal(param.detach(), effective[name]), name
            assert nm_violations(param, 1) == 0
    assert not any("_nm_" in name for name in model.state_dict())  # training state removed
    # FP8 simulation rounds X and W through e4m3 while training; the finalized model runs at full precision
    tolerance = {"atol": 0.1, "rtol": 0.1} if "fp8" in key else {"atol": 1e-5, "rtol": 1e-4}
    with torch.no_grad():
        torch.testing.assert_close(model(x), trained, **tolerance)


def test_s_ste_bakes_the_scaled_soft_threshold_not_the_masked_weight():
    model = MLP()
    nmcompile.annotate(model, "s_ste:2:4")
    w = model.fc2.weight.detach().clone()
    beta = reference.beta(w, 2, 4, 1)
    nmcompile.finalize(model)
    torch.testing.assert_close(model.fc2.weight.detach(), beta * reference.soft_threshold(w, 2, 4, 1))
    assert not torch.allclose(model.fc2.weight.detach(), w * reference.topn_mask(w, 2, 4, 1))


def test_finalize_is_idempotent_and_the_state_dict_loads_without_nmcompile(tmp_path):
    model, _, x = _trained_mlp("sr_ste:2:4")
    first = nmcompile.finalize(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    second = nmcompile.finalize(model)
    assert first == second
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    fresh = MLP()
    fresh.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x))
    path = tmp_path / "finalized.pt"
    torch.save(model.state_dict(), path)
    script = (
        "import sys, torch\n"
        "state = torch.load(sys.argv[1], weights_only=True)\n"
        "m = torch.nn.Sequential()\n"
        "assert 'nmcompile' not in sys.modules\n"
        "print(sorted(state))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(sorted(weights))


def test_mdgf_with_alpha_above_zero_is_refused_or_forced_with_the_change_reported():
    model = MLP()
    nmcompile.annotate(model, "mdgf:2:4")  # alpha = 1 at step 0: the forward weight is dense
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"(?s)fc1.weight \(mdgf:2:4\).*alpha is still > 0.*force=True"):
        nmcompile.finalize(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing changed
    with pytest.warns(UserWarning, match="pruned layers whose forward weight was not N:M"):
        report = nmcompile.finalize(model, force=True)
    assert all(d.change > 0.1 for d in report.values())
    torch.testing.assert_close(model.fc1.weight.detach(), before["fc1.weight"] * reference.topn_mask(before["fc1.weight"], 2, 4, 1))


def test_nothing_annotated_is_an_error_that_says_what_to_do():
    with pytest.raises(ValueError, match="no weight of MLP is annotated or finalized.*nmcompile.annotate"):
        nmcompile.finalize(MLP())
    with pytest.raises(TypeError, match="nn.Module"):
        nmcompile.finalize({"w": torch.zeros(4, 4)})


def test_a_training_compile_refuses_to_run_a_finalized_model():
    model, compiled, x = _trained_mlp("ste:2:4")
    nmcompile.finalize(model)
    with pytest.raises(Exception, match="finalized after this model was compiled"):
        compiled(x)


def test_conv_weights_finalize_along_input_channels():
    model = CNN()
    nmcompile.annotate(model, "ste:2:4")
    x = torch.randn(2, 3, 8, 8)
    effective = nmcompile.effective_weights(model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        expected = torch.func.functional_call(model, {**params, **effective}, (x,))
    nmcompile.finalize(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)
    assert nm_violations(model.conv2.weight, 1) == 0
    assert nmcompile.check(model).ok and set(nmcompile.check(model)) == set(effective)


def test_checkpoint_round_trip_through_bytes():
    model, _, _ = _trained_mlp("ste:2:4")
    nmcompile.finalize(model)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    assert nmcompile.check(torch.load(buffer, weights_only=True)).ok
