"""Every recipe trains through the backend on an MLP, a small CNN and a transformer layer.

Uses the checks of tests/models.py: N:M effective weights after training, one compilation (one per
schedule frame for SDGF), no graph break, compiled output equal to an eager forward with the
effective weights.
"""

import pytest
import torch
import torch.nn.functional as F

import nmcompile
from models import (  # noqa: F401  (_fresh_counters: the autouse fixture that zeroes counters)
    SCHEDULED,
    AOT, ATTN_WEIGHTS, CNN, CNN_WEIGHTS, FFN_WEIGHTS, MLP, MLP_WEIGHTS,
    _fresh_counters, _train_encoder, check_trained, encoder_layer, train,
)

RECIPES = SCHEDULED
# GEMM-level recipes cannot enter F.multi_head_attention_forward; tile recipes need out % 4 == 0
GEMM_LEVEL = {"bi_mask", "ste_mvue24", "s_ste_fp8_mvue24"}
TILED = {"bi_mask", "transposable"}
COMPILES = {"sdgf": 2}  # frames 3:4 then 2:4


def tolerance(key):
    # the FP8 simulation rounds X and W to e4m3 (3 mantissa bits): compare at that precision
    return {"atol": 0.1, "rtol": 0.1} if "fp8" in key else {}


def expected(weights, key, drop=()):
    return {name: dim for name, dim in weights.items() if name not in drop}


@pytest.mark.parametrize("key", RECIPES)
def test_mlp(key):
    model = MLP()
    nmcompile.annotate(model, RECIPES[key])
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    x, y = torch.randn(16, 16), torch.randn(16, 8)
    run = train(model, compiled, (x,), loss_fn=lambda out: F.mse_loss(out, y), lr=3e-3)
    check_trained(model, run, MLP_WEIGHTS, compiles=COMPILES.get(key, 1), **tolerance(key))


@pytest.mark.parametrize("key", RECIPES)
def test_cnn(key):
    model = CNN()
    report = nmcompile.annotate(model, RECIPES[key])
    names = expected(CNN_WEIGHTS, key, drop={"fc.weight"} if key in TILED else ())  # fc has 10 outputs
    if key == "s_ste_fp8_mvue24":
        names = {}
    assert set(report.annotated) == set(CNN_WEIGHTS if key not in TILED else names)
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    x, labels = torch.randn(4, 3, 8, 8), torch.tensor([0, 3, 5, 9])
    if not names:  # FP8 simulation is for linear GEMMs: every conv is skipped, and said so
        with pytest.warns(UserWarning, match="FP8 simulation covers linear GEMMs"):
            compiled(x)
        return
    run = train(model, compiled, (x,), loss_fn=lambda out: F.cross_entropy(out, labels), lr=3e-3)
    check_trained(model, run, names, compiles=COMPILES.get(key, 1))


@pytest.mark.parametrize("key", RECIPES)
def test_transformer_encoder_layer(key):
    model = encoder_layer()
    exclude = ["self_attn*"] if key in GEMM_LEVEL else None
    nmcompile.annotate(model, RECIPES[key], exclude=exclude)
    weights = FFN_WEIGHTS if key in GEMM_LEVEL else {**ATTN_WEIGHTS, **FFN_WEIGHTS}
    run = _train_encoder(model, AOT)
    check_trained(model, run, weights, compiles=COMPILES.get(key, 1), **tolerance(key))


def test_gemm_level_recipe_on_attention_is_skipped_with_a_reason(recwarn):
    model = encoder_layer()
    nmcompile.annotate(model, "ste:2:4,wgrad=mvue24")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    compiled(torch.randn(2, 6, 32))
    text = "\n".join(str(w.message) for w in recwarn)
    assert "self_attn.in_proj_weight" in text and "changes the GEMM's backward" in text
