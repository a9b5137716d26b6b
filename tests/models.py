"""Shared by the model tests: small models (MLP, CNN, transformer layers, GPT-2 from a config), the
training loop with its checks (N:M effective weights, one compilation, no graph break, compiled
output equal to an eager forward with the effective weights), and the recipes with schedules sized
to its steps."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

import nmcompile
from nmcompile.recipes import step_kernels

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
        self.fc3 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


MLP_WEIGHTS = {"fc1.weight": 1, "fc2.weight": 1, "fc3.weight": 1}


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


FFN_WEIGHTS = {"linear1.weight": 1, "linear2.weight": 1}
ATTN_WEIGHTS = {"self_attn.in_proj_weight": 1, "self_attn.out_proj.weight": 1}


def _train_encoder(model, options):
    compiled = torch.compile(model, backend="nmsparse", options=options)
    x, y = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    return train(model, compiled, (x,), loss_fn=lambda out: F.mse_loss(out, y))

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


# schedules sized to the STEPS (20) optimizer steps of `train`, so that every run ends N:M
SCHEDULED = {
    "step": f"step:2:4,total_steps={STEPS},t_max=0.25,beta2=0.999",
    "mdgf": f"mdgf:2:4,decay_coef=0.05,finetune_fraction=0.5,total_steps={STEPS}",
    "sdgf": f"sdgf:2:4,total_steps={STEPS}",
    "bi_mask": "bi_mask:2:4,every=5,candidates=8",
    "transposable": "transposable:2:4,every=5",
    "asp": "asp:2:4",
    "ste_mvue24": "ste:2:4,wgrad=mvue24",
    "s_ste_fp8_mvue24": "s_ste:2:4,wgrad=mvue24,fp8=true",
}


def tiny_llama(transformers, hidden=64, intermediate=128, layers=2, vocab=256, tie=False):
    """A Llama from a config, random init (untied head unless ``tie``)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def magnitude_2_4(model):
    """Prune every linear and GPT-2 Conv1D weight but the head to 2:4 along its reduction dim by magnitude,
    then record them with ``finalize(model, pattern="2:4")``, as a pruned checkpoint loaded back would be."""
    from nmcompile.pattern import reduction_dim

    head = getattr(model, "lm_head", None)
    with torch.no_grad():
        for module in model.modules():
            weight = module._parameters.get("weight")
            if module is head or weight is None or weight.dim() != 2:
                continue
            dim = reduction_dim(module, "weight", weight)
            if dim is not None:
                weight.copy_(nmcompile.masks.prune(weight, 2, 4, dim))
    return nmcompile.finalize(model.eval(), pattern="2:4")


def packed_test_build():
    """Three linears and a head: the small model the packed-weight tests pack."""
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 48), nn.Linear(48, 10))


def packed_test_model(dtype=torch.float32):
    """:func:`packed_test_build`, its three linears finalized 2:4 with sr_ste (the head stays dense)."""
    torch.manual_seed(0)
    model = packed_test_build()
    nmcompile.annotate(model, "sr_ste:2:4", exclude=["3.*"])
    nmcompile.finalize(model)
    return model.to(dtype).eval()


# --------------------------------------------------------------------------------------------
# mixtures of experts as Hugging Face models: transformers' Mixtral (fused experts) and a
# hand-written one whose experts are separate nn.Linear modules
# --------------------------------------------------------------------------------------------


def tiny_mixtral_config(transformers, vocab=96, layers=2):
    """A Mixtral config: transformers 5 holds each layer's experts fused (``mlp.experts.gate_up_proj``
    [4, 64, 32], ``mlp.experts.down_proj`` [4, 32, 32]) and writes them one Linear weight per expert."""
    return transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )


_PER_EXPERT = {}


def _per_expert_config_init(self, vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, **kwargs):
    self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
    self.num_hidden_layers, self.num_experts = num_hidden_layers, num_experts
    self.num_experts_per_tok, self.max_position_embeddings = num_experts_per_tok, max_position_embeddings
    super(type(self), self).__init__(**kwargs)


def per_expert_moe_classes(transformers, model_type: str = "nmcompile_per_expert_moe"):
    """``(config class, model class)`` of a small causal LM whose experts are separate ``nn.Linear`` modules
    (``layers.{i}.experts.{e}.w1/w2/w3``, as Hugging Face MoE models were before transformers 5 fused
    them), registered under ``model_type`` with ``AutoConfig`` and ``AutoModelForCausalLM``."""
    if model_type in _PER_EXPERT:
        return _PER_EXPERT[model_type]

    class PerExpertMoeConfig(transformers.PretrainedConfig):
        pass

    PerExpertMoeConfig.model_type = model_type
    PerExpertMoeConfig.__init__ = _per_expert_config_init

    class Expert(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        """Causal mixing (a running mean of a projection) and a top-k mixture of experts."""

        def __init__(self, config):
            super().__init__()
            self.norm = nn.LayerNorm(config.hidden_size)
            self.mix = nn.Linear(config.hidden_size, config.hidden_size)
            self.k = config.num_experts_per_tok
            self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router: kept dense
            self.experts = nn.ModuleList(Expert(config) for _ in range(config.num_experts))

        def forward(self, x):
            steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device).view(1, -1, 1)
            x = x + self.mix(self.norm(x)).cumsum(1) / steps
            top, chosen = self.gate(x).softmax(-1).topk(self.k, dim=-1)
            out = x
            for e, expert in enumerate(self.experts):
                out = out + (top * (chosen == e)).sum(-1, keepdim=True) * expert(x)
            return out

    class PerExpertMoeForCausalLM(transformers.PreTrainedModel, transformers.GenerationMixin):
        config_class = PerExpertMoeConfig
        base_model_prefix = "model"

        def __init__(self, config):
            super().__init__(config)
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def forward(self, input_ids=None, labels=None, use_cache=None, **kwargs):
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x)
            logits = self.lm_head(x)
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    transformers.AutoConfig.register(model_type, PerExpertMoeConfig, exist_ok=True)
    transformers.AutoModelForCausalLM.register(PerExpertMoeConfig, PerExpertMoeForCausalLM, exist_ok=True)
    _PER_EXPERT[model_type] = PerExpertMoeConfig, PerExpertMoeForCausalLM
    return _PER_EXPERT[model_type]


def tiny_moe(transformers, kind: str, vocab=96, layers=2):
    """A small mixture of experts with random weights: ``"mixtral"`` (transformers' Mixtral, fused experts)
    or ``"per_expert"`` (:func:`per_expert_moe_classes`)."""
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(tiny_mixtral_config(transformers, vocab, layers))
    else:
        config_class, model_class = per_expert_moe_classes(transformers)
        model = model_class(config_class(vocab_size=vocab, num_hidden_layers=layers))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.1)  # transformers leaves fused expert weights uninitialised outside from_pretrained
    return model.eval()
