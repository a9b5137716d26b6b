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
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

import nmcompile
from nmcompile.recipes import step_kernels

RECIPES = ["ste:2:4", "sr_ste:2:4", "s_ste:2:4"]
STEPS = 20
AOT = {"inner": "aot_eager"}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def warm_step_kernels() -> None:
    """Compile STEP's fp32 optimizer kernels now, so the counters of a test see only the model's graphs."""
    p, g, m, v, frozen = (torch.ones(8) for _ in range(5))  # distinct tensors: Dynamo guards on aliasing
    with torch.no_grad():  # as in the optimizer hook (Dynamo guards on grad mode too)
        step_kernels.change_sum(v, g, 1, 1e-5)
        step_kernels.frozen_update(p, g, m, v, frozen, lr=0.1, beta1=0.9, beta2=0.99, bias1=0.1, bias2=0.1, eps=1e-8)


@pytest.fixture(autouse=True)
def _fresh_counters(monkeypatch, request):
    """Every test starts with no compiled code, zeroed Dynamo counters and no NMSPARSE_RECIPE."""
    monkeypatch.delenv("NMSPARSE_RECIPE", raising=False)
    torch._dynamo.reset()
    if "step" in request.node.name:
        warm_step_kernels()
    counters.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def nm_violations(w: torch.Tensor, dim: int, n: int = 2, m: int = 4) -> int:
    """Groups of ``m`` consecutive entries along ``dim`` with more than ``n`` non-zeros.

    Deliberately independent of nmcompile's own mask code.
    """
    g = w.detach().movedim(dim, -1)
    assert g.shape[-1] % m == 0, f"dim {dim} of {tuple(w.shape)} is not a multiple of {m}"
    nonzero = (g.reshape(*g.shape[:-1], g.shape[-1] // m, m) != 0).sum(-1)
    return int((nonzero > n).sum())


def assert_step_kernels_compiled_once() -> None:
    """STEP's fused optimizer kernels (compiled outside the model) did not recompile for other weights."""
    entries = [len(_debug_get_cache_entry_list(f.__code__)) for f in (step_kernels._change_sum, step_kernels._frozen_update)]
    assert max(entries) <= 1, f"STEP's optimizer kernels recompiled: {entries} graphs"


def assert_single_graph(compiles: int = 1) -> None:
    """Exactly one frame compiled into exactly one graph, no graph break, no recompile."""
    assert_step_kernels_compiled_once()
    frames = dict(counters["frames"])
    graphs = counters["stats"]["unique_graphs"]
    breaks = dict(counters["graph_break"])
    assert breaks == {}, f"graph breaks: {list(breaks)}"
    assert graphs == 1, f"{graphs} graphs compiled (recompile or graph break); frames={frames}"
    assert frames.get("total") == 1, f"Dynamo compiled {frames} frames, expected exactly one"
    # the backend compiles through AOTAutograd (aot_eager or Inductor); this also counts graphs
    # the backend compiles by itself, which Dynamo's counters do not see
    aot = counters["aot_autograd"]["total"]
    assert aot == compiles, f"{aot} AOTAutograd compilations, expected {compiles}"


@dataclass
class Trained:
    losses: list[float]
    output: torch.Tensor  # compiled output at the last step
    reference: torch.Tensor  # eager output with the effective weights of the last step
    dense: torch.Tensor  # eager output with the dense weights of the last step
    effective: dict[str, torch.Tensor]


def train(model, compiled, args=(), kwargs=None, *, loss_fn, output_fn=lambda out: out, lr=1e-3):
    """STEPS Adam steps through ``compiled``; the last step is also replayed eagerly."""
    kwargs = kwargs or {}
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    # runs the schedules of the recipes that have one; diagnostics (a compiled function of their
    # own) are tested in test_diagnostics and kept out of these compile counts
    nmcompile.hook_optimizer(model, opt, diagnostics_every=0)
    losses = []
    for step in range(STEPS):
        out = compiled(*args, **kwargs)
        loss = loss_fn(out)
        losses.append(loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == STEPS - 1:
            # weights are those the forward just used: compare before the optimizer moves them
            effective = nmcompile.effective_weights(model)
            params = dict(model.named_parameters())
            with torch.no_grad():
                reference = torch.func.functional_call(model, {**params, **effective}, args, kwargs)
                dense = model(*args, **kwargs)
            result = Trained(
                losses,
                output_fn(out).detach(),
                output_fn(reference),
                output_fn(dense),
                effective,
            )
        opt.step()
    return result


def check_trained(model, run: Trained, expected: dict[str, int], *, atol=1e-5, rtol=1e-4, compiles=1) -> None:
    """(a), (b) and (c) for a model trained by :func:`train`. ``expected``: {name: grouping dim}."""
    # (c) finite loss, and it went down on the fixed batch (the gradient reaches the weights)
    assert all(torch.isfinite(torch.tensor(run.losses))), run.losses
    assert run.losses[-1] < run.losses[0], run.losses
    # (b) one compilation (one per schedule frame), no graph break over all the steps
    assert_single_graph(compiles)
    # (a) exactly the expected weights are sparsified, along the expected dimension
    assert set(run.effective) == set(expected)
    report = nmcompile.check(model)
    assert set(report) == set(expected), str(report)
    assert report.ok, str(report)
    for name, dim in expected.items():
        assert report[name].dim == dim, (name, report[name])
        w = run.effective[name]
        assert nm_violations(w, dim) == 0, name
        assert (w == 0).float().mean() >= 0.5, f"{name} is not half zeros"
    # (c) compiled forward == eager forward with the effective weights, and != the dense forward
    torch.testing.assert_close(run.output, run.reference, atol=atol, rtol=rtol)
    assert (run.output - run.dense).abs().max() > 1e-3, "compiled output equals the dense model's"


def assert_s_ste_state(model, recipe: str, names) -> None:
    if recipe.startswith("s_ste"):
        state = model.state_dict()
        for name in names:
            beta = state[f"{name}_nm_beta"]
            assert beta.dim() == 0 and torch.isfinite(beta) and beta > 0, (name, beta)


def reported_skips(name: str, recwarn, caplog) -> list[str]:
    """Lines naming ``name`` in the backend's warnings or the "nmcompile" log (a skip report)."""
    texts = [str(w.message) for w in recwarn] + [r.getMessage() for r in caplog.records]
    return [line for text in texts for line in text.splitlines() if name in line]


def declare(model, recipe, route, monkeypatch, **filters):
    """Declare ``recipe`` through one of the three routes; return (annotate report, options)."""
    if route == "annotate":
        return nmcompile.annotate(model, recipe, **filters), dict(AOT)
    if route == "options":
        return None, {**AOT, "recipe": recipe, **filters}
    assert route == "env" and not filters
    monkeypatch.setenv("NMSPARSE_RECIPE", recipe)
    return None, dict(AOT)


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


MLP_WEIGHTS = {"fc1.weight": 1, "fc2.weight": 1, "head.weight": 1}


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)  # 3 input channels: cannot take 2:4
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 16, 1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x))
        return self.fc(x.mean((2, 3)))


CNN_WEIGHTS = {"conv2.weight": 1, "conv3.weight": 1, "fc.weight": 1}


def encoder_layer():
    return nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0)


# --------------------------------------------------------------------------------------------
# MLP: every recipe through every declaration route
# --------------------------------------------------------------------------------------------


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
    options = {**AOT, "recipe": "sr_ste:2:4", "include": ["fc*"], "exclude": ["fc2"]}
    compiled = torch.compile(model, backend="nmsparse", options=options)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    run = train(model, compiled, (x,), loss_fn=lambda out: F.mse_loss(out, y))
    check_trained(model, run, {"fc1.weight": 1})
    assert (model.fc2.weight != 0).all() and (model.head.weight != 0).all()


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

FFN_WEIGHTS = {"linear1.weight": 1, "linear2.weight": 1}
ATTN_WEIGHTS = {"self_attn.in_proj_weight": 1, "self_attn.out_proj.weight": 1}


def _train_encoder(model, options):
    compiled = torch.compile(model, backend="nmsparse", options=options)
    x, y = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    return train(model, compiled, (x,), loss_fn=lambda out: F.mse_loss(out, y))


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
    expected.update({"bert.pooler.dense.weight": 1, "classifier.weight": 1})
    assert set(report.annotated) == set(expected)
    assert all("embedding" in why for why in report.skipped.values()), report.skipped

    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    ids = torch.randint(0, 128, (4, 12))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 2, 1])}
    run = train(model, compiled, (), kwargs, loss_fn=lambda out: out.loss, output_fn=lambda out: out.logits)
    check_trained(model, run, expected)
    # embeddings stay dense
    assert nm_violations(model.bert.embeddings.word_embeddings.weight, 1) > 0


def _gpt2(transformers):
    config = transformers.GPT2Config(
        vocab_size=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return transformers.GPT2LMHeadModel(config)


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
