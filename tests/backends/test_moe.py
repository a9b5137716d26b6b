"""Stacked (MoE expert) weights ``[E, out, in]`` / ``[E, in, out]``: N:M per expert along the reduction dim.

Checked against plain references (each expert pruned on its own with ``tests.reference``), through
the backend options route and ``nmcompile.annotate``, for the GEMM forms expert code uses (``x @ W``,
``torch.bmm``, ``torch._grouped_mm``, ``W[e]`` then linear, ``W[expert_ids]`` then bmm) and a tiny
transformers Mixtral; then finalize, check, pack and ONNX. Everything compiles with
``inner="aot_eager"`` to stay fast.
"""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile
from nmcompile import masks
from nmcompile.pattern import reduction_dim

import reference as ref

AOT = {"inner": "aot_eager"}
E, A, B = 4, 8, 16  # experts and the two matrix axes of the synthetic weights


def per_expert(w: torch.Tensor, n: int, m: int, dim: int) -> torch.Tensor:
    """The reference: each expert's matrix pruned on its own along ``dim`` (counted from the end)."""
    return torch.stack([w[e] * ref.topn_mask(w[e], n, m, dim + 2) for e in range(w.shape[0])])


def violations(w: torch.Tensor, dim: int, n: int = 2, m: int = 4) -> int:
    """Groups of m along ``dim`` with more than n non-zeros (independent of nmcompile's masks)."""
    g = w.detach().movedim(dim, -1)
    return int(((g.reshape(*g.shape[:-1], -1, m) != 0).sum(-1) > n).sum())


def compile_and_run(model, args, recipe="sr_ste:2:4", **options):
    """One forward and backward through the backend; ``(output, warnings' texts, log lines)``."""
    compiled = torch.compile(model, backend="nmsparse", options={**AOT, "recipe": recipe, **options})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(*args)
        out.float().pow(2).sum().backward()
    texts = [str(w.message) for w in caught if "nmsparse" in str(w.message)]
    return out, texts


# ---------------------------------------------------------------------------------------------
# mask math: grouping along dim -1 / -2 of a 3-D tensor is per expert
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [-1, -2])
def test_masks_group_within_each_expert(dim):
    w = torch.randn(E, 16, 16)
    assert torch.equal(masks.prune(w, 2, 4, dim), per_expert(w, 2, 4, dim))
    assert torch.equal(masks.keep_mask(w, 1, 4, dim), per_expert(w, 1, 4, dim) != 0)
    # a change in one expert leaves the others' masks alone
    w2 = w.clone()
    w2[1] = torch.randn(16, 16)
    keep, keep2 = masks.keep_mask(w, 2, 4, dim), masks.keep_mask(w2, 2, 4, dim)
    assert torch.equal(keep[[0, 2, 3]], keep2[[0, 2, 3]])


def test_s_ste_scale_is_per_expert():
    """S-STE's beta is defined per layer; each expert is a layer: one beta per expert."""
    w = torch.randn(E, A, B)
    w[2] *= 10  # an expert of another scale gets its own beta
    beta = masks.soft_threshold_scale(w, 2, 4, -2)
    assert beta.shape == (E, 1, 1)
    want = torch.stack([ref.beta(w[e], 2, 4, dim=0) for e in range(E)])
    torch.testing.assert_close(beta.flatten(), want, rtol=1e-5, atol=0)
    # a conv-like weight (non-negative dim) keeps one scale for the whole tensor
    assert masks.soft_threshold_scale(w, 2, 4, 1).dim() == 0


# ---------------------------------------------------------------------------------------------
# GEMM forms of expert code, through the backend options route
# ---------------------------------------------------------------------------------------------


class Experts(nn.Module):
    """``weight`` [E, A, B] used by one GEMM form; ``dim`` is the reduction dim it must be grouped along."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.weight = nn.Parameter(torch.randn(E, A, B))

    def forward(self, x):
        w = self.weight
        if self.form == "x @ W":  # x [E, T, A] @ W [E, A, B]: reduces A
            return x @ w
        if self.form == "bmm(W, x)":  # W [E, A, B] @ x [E, B, T]: reduces B
            return torch.bmm(w, x)
        if self.form == "grouped_mm":  # x [S, A] grouped by offs, W [E, A, B]: reduces A
            offs = torch.tensor([2, 5, 5, 8], dtype=torch.int32)
            return torch._grouped_mm(x, w, offs=offs)
        if self.form == "grouped_mm(x, W^T)":  # transformers' layout: W [E, out, in], reduces in (B)
            offs = torch.tensor([2, 5, 5, 8], dtype=torch.int32)
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        if self.form == "linear(x, W[e])":  # a loop over experts: W[e] is [out, in], reduces B
            return torch.stack([F.linear(x[e], w[e]) for e in range(E)])
        if self.form == "bmm(x, W[ids])":  # batched_mm experts: gathered per token, reduces A
            ids = torch.tensor([0, 3, 3, 1, 2, 0])
            return torch.bmm(x.unsqueeze(1), w[ids]).squeeze(1)
        raise AssertionError(self.form)


# torch._grouped_mm compiles for bfloat16 only (its meta kernel refuses float32)
FORMS = {  # form: (input shape, reduction dim of the weight)
    "x @ W": ((E, 3, A), -2),
    "bmm(W, x)": ((E, B, 3), -1),
    "grouped_mm": ((8, A), -2),
    "grouped_mm(x, W^T)": ((8, B), -1),
    "linear(x, W[e])": ((E, 3, B), -1),
    "bmm(x, W[ids])": ((6, A), -2),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_gemm_forms_prune_per_expert_along_the_reduction_dim(form, caplog):
    shape, dim = FORMS[form]
    dtype = torch.bfloat16 if "grouped" in form else torch.float32
    model = Experts(form).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    with caplog.at_level(logging.INFO, logger="nmcompile"):
        out, texts = compile_and_run(model, (x,), "sr_ste:2:4")
    assert texts == []  # nothing left dense
    assert "nmsparse: weight <- sr_ste:2:4 (from options)" in caplog.text
    w = model.weight.detach()
    pruned = per_expert(w, 2, 4, dim)
    # forward: the model's own code on the reference weights
    want = torch.func.functional_call(model, {"weight": pruned}, (x,))
    torch.testing.assert_close(out, want)
    assert torch.equal(nmcompile.effective_weights(model)["weight"], pruned)
    report = nmcompile.check(model)
    assert report.ok and report["weight"].dim == dim
    assert violations(w * (pruned != 0), dim) == 0
    # backward: the dense gradient of the effective weight, plus SR-STE's decay on the pruned entries
    w_ref = pruned.clone().requires_grad_(True)
    torch.func.functional_call(model, {"weight": w_ref}, (x,)).pow(2).sum().backward()
    torch.testing.assert_close(model.weight.grad, w_ref.grad + 2e-4 * (pruned == 0).to(w.dtype) * w, atol=1e-2, rtol=1e-2)


def test_the_expert_axis_is_never_grouped():
    """The reported bug: ``x @ W`` with W [4, 8, 12] was grouped along dim 0 (the 4 experts)."""
    model = Experts("x @ W")
    model.weight.data = torch.randn(4, 8, 12)
    compile_and_run(model, (torch.randn(4, 3, 8),), "ste:2:4")
    effective = nmcompile.effective_weights(model)["weight"]
    assert violations(effective, 1) == 0
    assert violations(effective, 0) > 0  # grouped along the experts it would comply, and it does not


# ---------------------------------------------------------------------------------------------
# recipes per expert
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["ste:2:4", "s_ste:2:4", "asp:2:4,permute=0", "transposable:2:4,every=1",
                                    "mdgf:2:4,decay_coef=0,finetune_fraction=0.5,total_steps=2",
                                    "sdgf:2:4,schedule=2:4,total_steps=1", "step:2:4,total_steps=2,t_min=0,t_max=0"])
def test_recipes_per_expert(recipe):
    model = Experts("x @ W")  # [E, in, out]: dim -2
    model.weight.data = torch.randn(E, 8, 8)
    x = torch.randn(E, 3, 8)
    compiled = torch.compile(model, backend="nmsparse", options={**AOT, "recipe": recipe})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    nmcompile.hook_optimizer(model, opt, diagnostics_every=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # recipe state created at the first forward
        for _ in range(2):
            out = compiled(x)
            opt.zero_grad()
            out.pow(2).sum().backward()
            assert model.weight.grad is not None and model.weight.grad.abs().sum() > 0
            opt.step()
    effective = nmcompile.effective_weights(model)["weight"]
    assert violations(effective, -2) == 0, recipe
    assert nmcompile.check(model).ok, recipe  # the recipe state of each expert is what the recipe makes
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), x @ effective)
    name = recipe.split(":")[0]
    if name == "s_ste":
        beta = model.weight_nm_beta
        assert beta.shape == (E, 1, 1)
        s = torch.stack([ref.soft_threshold(model.weight[e].detach(), 2, 4, dim=0) for e in range(E)])
        torch.testing.assert_close(effective, beta * s)
    if name == "transposable":  # each expert's matrix is 2:4 along both of its axes
        mask = model.weight_nm_mask.bool()
        for e in range(E):
            assert masks.is_transposable(mask[e], 2, 4)


@pytest.mark.parametrize("recipe, reason", [
    ("bi_mask:2:4", "bi_mask on a stacked \\(expert\\) weight"),
    ("sr_ste:2:4,wgrad=mvue24", "changes the GEMM's backward"),
    ("s_ste:2:4,fp8=1", "changes the GEMM's backward"),
])
def test_recipes_that_do_not_work_per_expert_are_named_skips(recipe, reason):
    model = Experts("x @ W")
    out, texts = compile_and_run(model, (torch.randn(E, 3, A),), recipe)
    assert len(texts) == 1
    assert texts[0].startswith("nmsparse left these weights dense:\n  weight: ")
    assert re.search(reason, texts[0]), texts[0]
    assert nmcompile.effective_weights(model) == {}  # left dense, not guessed


# ---------------------------------------------------------------------------------------------
# weights whose reduction dim cannot be told: named, never guessed
# ---------------------------------------------------------------------------------------------


class Ambiguous(nn.Module):
    def __init__(self, use: str):
        super().__init__()
        self.use = use
        self.weight = nn.Parameter(torch.randn(E, 8, 8))

    def forward(self, x):
        w = self.weight
        if self.use == "two dims":
            return x @ w + w @ x
        if self.use == "einsum":
            return torch.einsum("eti,eio->eto", x, w)
        if self.use == "view and sum":
            v = w.transpose(-2, -1)
            return x @ v + v.sum()
        raise AssertionError(self.use)


@pytest.mark.parametrize("use, reason", [
    ("two dims", "used with two different reduction dimensions"),
    ("einsum", "cannot tell one reduction dimension"),
    ("view and sum", "cannot tell one reduction dimension"),
])
def test_ambiguous_stacked_weight_is_a_named_skip(use, reason):
    model = Ambiguous(use)
    x = torch.randn(E, 8, 8)
    out, texts = compile_and_run(model, (x,), "ste:2:4")
    assert len(texts) == 1 and texts[0].startswith("nmsparse left these weights dense:\n  weight: "), texts
    assert reason in texts[0]
    torch.testing.assert_close(out, model(x))  # dense
    assert nmcompile.effective_weights(model) == {}


# ---------------------------------------------------------------------------------------------
# a tiny transformers Mixtral: training, finalize, check, pack, ONNX
# ---------------------------------------------------------------------------------------------


def tiny_mixtral(experts_implementation: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        use_cache=False,
    )
    model = transformers.MixtralForCausalLM._from_config(config, experts_implementation=experts_implementation)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.1)  # transformers leaves expert weights uninitialised outside from_pretrained
    return model


EXPERT_WEIGHTS = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")


def test_reduction_dim_of_transformers_experts():
    experts = tiny_mixtral("grouped_mm").model.layers[0].mlp.experts
    assert reduction_dim(experts, "gate_up_proj", experts.gate_up_proj) == -1  # [E, 2I, H]: reduces H
    assert reduction_dim(experts, "down_proj", experts.down_proj) == -1
    experts.is_transposed = True  # [E, in, out] layouts (GPT-OSS, Aria)
    assert reduction_dim(experts, "down_proj", experts.down_proj) == -2
    plain = nn.Module()
    plain.w = nn.Parameter(torch.randn(E, 8, 8))
    assert reduction_dim(plain, "w", plain.w) is None  # an unknown 3-D parameter: not guessed


@pytest.mark.slow
def test_tiny_mixtral_trains_sr_ste_per_expert(caplog, tmp_path):
    model = tiny_mixtral("grouped_mm")  # transformers' default; on CPU fp32 its grouped_mm_fallback op
    ids = torch.randint(0, 64, (2, 8))
    compiled = torch.compile(model, backend="nmsparse", options={**AOT, "recipe": "sr_ste:2:4"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="nmcompile"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = []
        for _ in range(3):
            loss = compiled(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if name in EXPERT_WEIGHTS}
            opt.step()
            losses.append(loss.item())
    assert not [w for w in caught if "left these weights dense" in str(w.message)]
    for name in EXPERT_WEIGHTS:
        assert f"nmsparse: {name} <- sr_ste:2:4 (from options)" in caplog.text
        assert grads[name].abs().sum() > 0
    assert all(torch.isfinite(torch.tensor(losses)))
    effective = nmcompile.effective_weights(model)
    params = dict(model.named_parameters())
    for name in EXPERT_WEIGHTS:
        assert effective[name].shape == params[name].shape
        assert torch.equal(effective[name], per_expert(params[name].detach(), 2, 4, -1))
    # the compiled forward computes the model on the effective weights
    with torch.no_grad():
        want = torch.func.functional_call(model, {**params, **effective}, (ids,)).logits
        torch.testing.assert_close(compiled(ids).logits, want, atol=1e-5, rtol=1e-4)
    report = nmcompile.check(model)
    assert report.ok and all(report[name].dim == -1 for name in EXPERT_WEIGHTS)

    finalized = nmcompile.finalize(model)
    assert all(finalized[name].dim == -1 for name in EXPERT_WEIGHTS)
    assert nmcompile.check(model).ok
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, atol=1e-5, rtol=1e-4)
    # pack / unpack: the [E, out, in] expert weights are 2:4 along their last dim
    for name in EXPERT_WEIGHTS:
        weight = params[name].detach()
        packed = nmcompile.pack(weight)
        assert packed.values.shape == (*weight.shape[:-1], weight.shape[-1] // 2)
        assert torch.equal(nmcompile.unpack(packed), weight)
    state = nmcompile.deploy.pack_state_dict(model.state_dict())
    assert all(name + ".nm24_meta" in state for name in EXPERT_WEIGHTS)
    assert nmcompile.check(state, dim=-1)[EXPERT_WEIGHTS[0]].ok


@pytest.mark.slow
def test_tiny_mixtral_annotate_finalize_onnx(tmp_path):
    """ONNX through the batched_mm experts (gather + MatMul); the grouped_mm implementations have no
    ONNX translation (the exporter fails on torch._grouped_mm / transformers' fallback op)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = tiny_mixtral("batched_mm")
    asp = nmcompile.annotate(tiny_mixtral("batched_mm"), "asp:2:4", include=["*experts*"])  # permute on
    assert set(asp.annotated) == set(EXPERT_WEIGHTS)
    assert all("stacked (expert) weight" in asp.prepared["asp:2:4"].skipped[name] for name in EXPERT_WEIGHTS)
    report = nmcompile.annotate(model, "sr_ste:2:4", include=["*experts*"])
    assert set(report.annotated) == set(EXPERT_WEIGHTS)
    ids = torch.randint(0, 64, (2, 8))
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = compiled(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    nmcompile.finalize(model)
    # the deploy route keeps expert GEMMs dense (the 2:4 kernels take linear weights), with the reason
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="nmsparse", options=AOT)(ids).logits, model(ids).logits)
    for name, decision in nmcompile.deploy_report(model).items():
        assert decision.kernel == "dense" and "per-expert GEMM" in decision.reason, (name, decision)

    class Logits(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids).logits

    path = tmp_path / "mixtral.onnx"
    exported = nmcompile.export_onnx(Logits(model), (ids,), path, dynamic_batch=False)
    assert len(exported.initializers) == 2
    assert {entry["parameter"] for entry in exported.initializers.values()} == {"lm." + n for n in EXPERT_WEIGHTS}
    assert all(entry["axis"] == -1 for entry in exported.initializers.values())
    assert exported.check.ok and exported.max_abs_diff < 1e-4
    assert nmcompile.check(str(path)).ok
