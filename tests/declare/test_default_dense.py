"""Output heads and MoE routers stay dense under catch-all declarations, on every route, and say so.

A rule or ``include`` that spells the layer's name sparsifies it; ``default_dense`` replaces or
(``[]``) turns off the defaults; a gated MLP's ``gate`` projection (wider than its input) is no router.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile import recipes
from nmcompile.declare.plan import Plan
from nmcompile.state.records import annotation_of

AOT = {"inner": "aot_eager"}
SR = recipes.SRSTE()


class TinyLM(nn.Module):
    """Embedding, an MLP with a router-shaped ``gate`` and a gated-MLP ``gate``, and an ``lm_head``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 32)
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(32, 4, bias=False)  # [experts, hidden]: a router
        self.mlp.up = nn.Linear(32, 64)
        self.ffn = nn.Module()
        self.ffn.gate = nn.Linear(32, 64)  # [64, 32]: a gated MLP's projection, not a router
        self.lm_head = nn.Linear(64 + 64 + 4, 40)

    def forward(self, ids):
        h = self.emb(ids)
        return self.lm_head(torch.cat([self.mlp.up(h), self.ffn.gate(h), self.mlp.gate(h)], -1))


SPARSE = {"mlp.up.weight", "ffn.gate.weight"}
DEFAULT_DENSE = {"mlp.gate.weight", "lm_head.weight"}


def shapes(model):
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("name,shape,kept", [
    ("lm_head.weight", (40, 64), True),
    ("model.lm_head.weight", (40, 64), True),
    ("head.weight", (10, 64), True),
    ("blocks.0.head.weight", (10, 64), True),
    ("classifier.weight", (2, 64), True),
    ("classifier.out_proj.weight", (2, 64), True),  # inside a classification head
    ("score.weight", (2, 64), True),
    ("output.weight", (40, 64), True),
    ("layers.0.attention.output.weight", (64, 64), False),  # only a top-level `output` is a head
    ("model.layers.0.block_sparse_moe.gate.weight", (8, 64), True),
    ("model.layers.0.mlp.shared_expert_gate.weight", (1, 64), True),
    ("model.layers.0.mlp.router.classifier.weight", (8, 64), True),
    ("model.layers.0.mlp.gate.weight", (256, 64), False),  # wider than its input: a gated MLP
    ("model.layers.0.mlp.gate_proj.weight", (8, 64), False),
    ("blocks.0.fc1.weight", (64, 64), False),
])
def test_catch_all_rules_keep_heads_and_routers_dense(name, shape, kept):
    for plan in (Plan.build("sr_ste:2:4"), Plan.build({"*.weight": "sr_ste:2:4"}), Plan.build({"*": SR})):
        assert (plan.recipe_for(name, shape) is None) is kept
        reason = plan.filtered_out(name, shape)
        assert (reason is not None and reason.startswith("kept dense by default")) is kept


def test_a_rule_or_include_that_names_the_layer_reaches_it():
    assert Plan.build({"lm_head": "ste", "*": "sr_ste"}).recipe_for("lm_head.weight") == recipes.STE()
    assert Plan.build({"*.lm_head.weight": "ste"}).recipe_for("m.lm_head.weight") == recipes.STE()
    assert Plan.build({"model.layers.*.mlp.gate": "ste"}).recipe_for("model.layers.3.mlp.gate.weight", (8, 64))
    assert Plan.build("sr_ste", include=["lm_head", "*"]).recipe_for("lm_head.weight") == SR
    # wildcards in the layer's own name do not name it
    assert Plan.build({"*head*": "sr_ste"}).recipe_for("lm_head.weight") is None
    assert Plan.build("sr_ste", include=["*head"]).recipe_for("lm_head.weight") is None
    # an explicit dense rule stays dense, and says nothing about defaults
    plan = Plan.build({"lm_head": "dense", "*": "sr_ste"})
    assert plan.recipe_for("lm_head.weight") is None and plan.kept_by_default("lm_head.weight") is None


def test_default_dense_replaces_or_turns_off_the_defaults(tmp_path):
    assert Plan.build("sr_ste", default_dense=[]).recipe_for("lm_head.weight") == SR
    plan = Plan.build("sr_ste", default_dense=["proj"])
    assert plan.recipe_for("lm_head.weight") == SR and plan.recipe_for("proj.weight") is None
    assert "default_dense" in plan.filtered_out("proj.weight")
    path = tmp_path / "rules.toml"
    path.write_text('recipe = "sr_ste:2:4"\ndefault_dense = []\n')
    assert Plan.build(str(path)).recipe_for("mlp.gate.weight", (4, 32)) == SR
    with pytest.raises(TypeError, match="default_dense takes a glob"):
        Plan.build("sr_ste", default_dense=[3])


def test_annotate_reports_them_as_kept_dense_by_default():
    model = TinyLM()
    report = nmcompile.annotate(model, "sr_ste:2:4", exclude=["emb"], strict=True)  # strict: defaults are no errors
    assert set(report.annotated) == SPARSE
    for name in DEFAULT_DENSE:
        assert report.skipped[name].startswith("kept dense by default")
        assert "names them" in report.skipped[name]
    assert "a MoE router" in report.skipped["mlp.gate.weight"]
    assert "an output head" in report.skipped["lm_head.weight"]
    everything = nmcompile.annotate(TinyLM(), "sr_ste:2:4", default_dense=[])
    assert set(everything.annotated) == SPARSE | DEFAULT_DENSE


def _compile_once(model, **options):
    compiled = torch.compile(model, backend="nmsparse", options={**AOT, **options})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randint(0, 40, (2, 8))).sum().backward()
    return [str(w.message) for w in caught if "nmsparse" in str(w.message)]


def _declared(model):
    return {f"{mname}.{p}" if mname else p for mname, mod in model.named_modules()
            for p, _ in mod.named_parameters(recurse=False) if annotation_of(mod, p) is not None}


def test_options_route_keeps_them_dense_and_warns_once_per_graph():
    model = TinyLM()
    texts = _compile_once(model, recipe="sr_ste:2:4", strict=True)
    assert _declared(model) == SPARSE
    said = [t for t in texts if "kept dense by default" in t]
    assert len(said) == 1 and all(name in said[0] for name in DEFAULT_DENSE) and "(from options)" in said[0]
    model = TinyLM()  # naming them reaches them; setting default_dense says the user knows: no warning
    texts = _compile_once(model, recipe={"lm_head": "ste:2:4", "*": "sr_ste:2:4"}, default_dense=["mlp.gate"])
    assert _declared(model) == SPARSE | {"lm_head.weight"}
    assert not [t for t in texts if "kept dense by default" in t]


def test_environment_route_keeps_them_dense(monkeypatch):
    monkeypatch.setenv("NMSPARSE_RECIPE", "sr_ste:2:4")
    model = TinyLM()
    texts = _compile_once(model)
    assert _declared(model) == SPARSE
    assert any("kept dense by default" in t and "(from NMSPARSE_RECIPE)" in t for t in texts)


def test_region_route_keeps_them_dense_and_says_how_to_name_them():
    class Regioned(TinyLM):
        def forward(self, ids):
            with nmcompile.region("sr_ste:2:4"):
                return super().forward(ids)

    model = Regioned()
    texts = _compile_once(model)
    assert _declared(model) == SPARSE
    said = [t for t in texts if "kept dense by default" in t]
    assert said and "a region names no weight" in said[0]


@pytest.mark.slow
def test_tiny_mixtral_router_and_head_stay_dense_experts_go_sparse():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        use_cache=False, tie_word_embeddings=False,
    )
    model = transformers.MixtralForCausalLM._from_config(config)
    report = nmcompile.annotate(model, "sr_ste:2:4")
    assert "kept dense by default: a MoE router" in report.skipped["model.layers.0.mlp.gate.weight"]
    assert "kept dense by default: an output head" in report.skipped["lm_head.weight"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in report.annotated
    assert "model.layers.0.self_attn.q_proj.weight" in report.annotated
