"""End-to-end training through the ``nmsparse`` backend on real model families.

For every model: (a) the expected weights, and only those, are sparsified (N:M checked both by
``nmcompile.check`` and by an independent count in this file); (b) 20 Adam steps give exactly one
Dynamo compilation and no graph break; (c) the loss stays finite and the compiled output equals an
eager forward of the same model with its weights replaced by ``nmcompile.effective_weights``.

Almost everything compiles with ``inner="aot_eager"`` (no Inductor) to keep CI fast; one MLP case
goes through Inductor.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile
from models import (  # noqa: F401  (_fresh_counters: the autouse fixture that zeroes counters)
    _fresh_counters, AOT, ATTN_WEIGHTS, CNN, CNN_WEIGHTS, FFN_WEIGHTS, MLP, MLP_WEIGHTS, _gpt2, _train_encoder, assert_s_ste_state, assert_single_graph, check_trained, declare, encoder_layer, nm_violations, reported_skips, train,
)

RECIPES = ["ste:2:4", "sr_ste:2:4", "s_ste:2:4"]


@pytest.mark.parametrize("route", ["annotate", "options", "env"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_mlp(recipe, route, monkeypatch):
    model = MLP()
    report, options = declare(model, recipe, route, monkeypatch)
    if report is not None:
        assert set(report.annotated) == set(MLP_WEIGHTS)
    compiled = torch.compile(model, backend="nmsparse", options=options)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    run = train(model, compiled, (x,), loss_fn=lambda out: F.mse_loss(out, y))
    check_trained(model, run, MLP_WEIGHTS)
    assert_s_ste_state(model, recipe, MLP_WEIGHTS)


def test_mlp_include_exclude_options():
    model = MLP()
    options = {**AOT, "recipe": "sr_ste:2:4", "include": ["fc1", "fc2"], "exclude": ["fc2"]}
    compiled = torch.compile(model, backend="nmsparse", options=options)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    run = train(model, compiled, (x,), loss_fn=lambda out: F.mse_loss(out, y))
    check_trained(model, run, {"fc1.weight": 1})
    assert (model.fc2.weight != 0).all() and (model.fc3.weight != 0).all()


@pytest.mark.inductor
@pytest.mark.slow
def test_mlp_inductor():
    """The one MLP case through Inductor (slow on a cold cache): S-STE, whose state is an input."""
    model = MLP()
    nmcompile.annotate(model, "s_ste:2:4")
    compiled = torch.compile(model, backend="nmsparse")
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    run = train(model, compiled, (x,), loss_fn=lambda out: F.mse_loss(out, y))
    check_trained(model, run, MLP_WEIGHTS, atol=1e-5, rtol=1e-4)


def test_recompile_is_detected():
    """The one-compilation assertion fails when the model does recompile (new batch size)."""
    model = MLP()
    nmcompile.annotate(model, "ste:2:4")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    compiled(torch.randn(8, 16))
    assert_single_graph()
    compiled(torch.randn(5, 16))
    with pytest.raises(AssertionError, match="graphs compiled"):
        assert_single_graph()


def test_sequential_s_ste():
    """nn.Sequential parameter names start with a digit ("0.weight"); S-STE state must still
    become valid graph inputs (regression: placeholder "0_weight_nm_beta" failed to compile)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    nmcompile.annotate(model, "s_ste:2:4")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    run = train(model, compiled, (x,), loss_fn=lambda out: F.mse_loss(out, y))
    check_trained(model, run, {"0.weight": 1, "2.weight": 1})


# --------------------------------------------------------------------------------------------
# CNN
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_cnn(recipe):
    model = CNN()
    report = nmcompile.annotate(model, recipe)
    assert set(report.annotated) == set(CNN_WEIGHTS)
    assert "conv1.weight" in report.skipped and "not divisible by M=4" in report.skipped["conv1.weight"]
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    x, labels = torch.randn(4, 3, 8, 8), torch.tensor([0, 3, 5, 9])
    run = train(model, compiled, (x,), loss_fn=lambda out: F.cross_entropy(out, labels))
    check_trained(model, run, CNN_WEIGHTS)
    assert (model.conv1.weight != 0).all()
    assert_s_ste_state(model, recipe, CNN_WEIGHTS)


def test_cnn_options_reports_skipped_conv(caplog, recwarn):
    model = CNN()
    compiled = torch.compile(model, backend="nmsparse", options={**AOT, "recipe": "sr_ste:2:4"})
    x, labels = torch.randn(4, 3, 8, 8), torch.tensor([0, 3, 5, 9])
    with caplog.at_level(logging.INFO, logger="nmcompile"):
        run = train(model, compiled, (x,), loss_fn=lambda out: F.cross_entropy(out, labels))
    check_trained(model, run, CNN_WEIGHTS)
    skipped = reported_skips("conv1.weight", recwarn, caplog)
    assert skipped and "not divisible by M=4" in skipped[0], skipped


# --------------------------------------------------------------------------------------------
# nn.TransformerEncoderLayer
# --------------------------------------------------------------------------------------------



@pytest.mark.parametrize("recipe", RECIPES)
def test_transformer_encoder_layer(recipe):
    """Attention projections (inside F.multi_head_attention_forward) and the feed-forward."""
    model = encoder_layer()
    report = nmcompile.annotate(model, recipe)
    assert set(report.annotated) == {**ATTN_WEIGHTS, **FFN_WEIGHTS}.keys()
    run = _train_encoder(model, AOT)
    check_trained(model, run, {**ATTN_WEIGHTS, **FFN_WEIGHTS})
    assert_s_ste_state(model, recipe, {**ATTN_WEIGHTS, **FFN_WEIGHTS})


def test_transformer_encoder_layer_ffn_only():
    model = encoder_layer()
    report = nmcompile.annotate(model, "s_ste:2:4", exclude=["self_attn*"])
    assert set(report.annotated) == set(FFN_WEIGHTS)
    run = _train_encoder(model, AOT)
    check_trained(model, run, FFN_WEIGHTS)


@pytest.mark.parametrize("route", ["annotate", "options"])
def test_transformer_encoder_layer_attention(route, monkeypatch):
    model = encoder_layer()
    report, options = declare(model, "sr_ste:2:4", route, monkeypatch)
    if report is not None:
        assert set(report.annotated) == {**ATTN_WEIGHTS, **FFN_WEIGHTS}.keys()
    run = _train_encoder(model, options)
    check_trained(model, run, {**ATTN_WEIGHTS, **FFN_WEIGHTS})


# --------------------------------------------------------------------------------------------
# Hugging Face models (tiny random-init configs)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["sr_ste:2:4"])
def test_bert_for_sequence_classification(recipe):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        # left unset, BERT's first forward writes config.problem_type, which fails a Dynamo
        # guard and recompiles (a transformers behaviour, not nmcompile's)
        problem_type="single_label_classification",
    )
    model = transformers.BertForSequenceClassification(config)
    report = nmcompile.annotate(model, recipe)
    linears = [
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    ]
    expected = {f"bert.encoder.layer.{i}.{lin}.weight": 1 for i in range(2) for lin in linears}
    expected.update({"bert.pooler.dense.weight": 1})
    assert set(report.annotated) == set(expected)
    assert report.skipped.pop("classifier.weight").startswith("kept dense by default: an output head")
    assert all("embedding" in why for why in report.skipped.values()), report.skipped

    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    ids = torch.randint(0, 128, (4, 12))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 2, 1])}
    run = train(model, compiled, (), kwargs, loss_fn=lambda out: out.loss, output_fn=lambda out: out.logits)
    check_trained(model, run, expected)
    # embeddings stay dense
    assert nm_violations(model.bert.embeddings.word_embeddings.weight, 1) > 0




@pytest.mark.slow
@pytest.mark.parametrize("route,recipe", [("annotate", "ste:2:4"), ("options", "s_ste:2:4")])
def test_gpt2_lm_head_model(route, recipe, monkeypatch, recwarn, caplog):
    caplog.set_level(logging.INFO, logger="nmcompile")
    transformers = pytest.importorskip("transformers")
    model = _gpt2(transformers)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    report, options = declare(model, recipe, route, monkeypatch)
    blocks = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    # Conv1D weights are [in, out]: groups run along dim 0
    expected = {f"transformer.h.{i}.{b}.weight": 0 for i in range(2) for b in blocks}
    if report is not None:
        assert set(report.annotated) == set(expected)
        assert "tied" in report.skipped["transformer.wte.weight"]
        assert "lm_head.weight" in report.skipped["transformer.wte.weight"]

    compiled = torch.compile(model, backend="nmsparse", options=options)
    ids = torch.randint(0, 256, (2, 16))

    def lm_loss(logits):  # the loss is computed outside the compiled model
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    run = train(
        model,
        compiled,
        (ids,),
        loss_fn=lambda out: lm_loss(out.logits),
        output_fn=lambda out: out.logits,
    )
    check_trained(model, run, expected)
    for name in expected:  # N:M along dim 0 (in), not along dim 1 (out)
        assert nm_violations(run.effective[name], 1) > 0, name
    # the tied embedding / LM head stays dense and tied
    assert "lm_head.weight" not in run.effective and "transformer.wte.weight" not in run.effective
    assert model.lm_head.weight is model.transformer.wte.weight
    assert (model.transformer.wte.weight != 0).all()
    if route == "options":  # the backend reports the tied weight it leaves dense
        skipped = reported_skips("transformer.wte.weight", recwarn, caplog)
        assert skipped and "tied" in skipped[0], skipped
    assert_s_ste_state(model, recipe, expected)
