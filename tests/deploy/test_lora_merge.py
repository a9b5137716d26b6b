"""LoRA adapters on an N:M model (``peft``): the backend masks each adapter's update by its base layer's mask, so
``merge_adapters`` gives a model that is still N:M and computes what the trained one did; ``peft``'s own merge
fills the pruned positions."""

import copy

import pytest
import torch

import nmcompile
from nmcompile.deploy import merge_adapters
from nmcompile.passes.mask_adapter_updates import mask_adapter_updates
from models import _gpt2, magnitude_2_4, tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


def _trained(kind="llama", steps=8):
    """A 2:4 model with LoRA adapters trained through the backend; ``(peft model, compiled, unmerged loss)``."""
    torch.manual_seed(0)
    model = tiny_llama(transformers) if kind == "llama" else _gpt2(transformers)
    magnitude_2_4(model)  # pruned and recorded, as a loaded pruned checkpoint is
    targets = ["q_proj", "v_proj", "up_proj", "down_proj"] if kind == "llama" else ["c_attn", "c_fc"]
    lora = peft.get_peft_model(model.eval(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                             target_modules=targets, fan_in_fan_out=kind == "gpt2"))
    report = nmcompile.annotate(lora, "asp:2:4,permute=0")
    assert not any("lora_" in name for name in report.annotated)  # adapters stay dense by default
    assert any("kept dense by default: a LoRA adapter" in why for why in report.skipped.values())
    compiled = torch.compile(lora, backend="nmsparse", options={"inner": "aot_eager"}, dynamic=False)
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss = compiled(input_ids=IDS, labels=IDS).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    lora.eval()
    with torch.no_grad():
        unmerged = float(compiled(input_ids=IDS, labels=IDS).loss)
    return lora, compiled, unmerged


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_masked_merge_keeps_2_4_and_the_trained_model_outputs(kind):
    lora, _, unmerged = _trained(kind)
    plain = copy.deepcopy(lora).merge_and_unload()  # peft's dense update
    weight = plain.get_submodule("model.layers.0.self_attn.q_proj" if kind == "llama" else "transformer.h.0.attn.c_attn")
    assert float((weight.weight == 0).float().mean()) < 0.1  # dense again: what merge_adapters avoids
    merged = merge_adapters(lora)
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    checked = nmcompile.check(merged)
    assert checked.ok and len(checked) == (14 if kind == "llama" else 8)
    with torch.no_grad():
        got = float(merged(input_ids=IDS, labels=IDS).loss)
        dense_update = float(plain(input_ids=IDS, labels=IDS).loss)
    assert abs(got - unmerged) < 1e-5  # the merged model is the trained one
    assert abs(dense_update - unmerged) > 1e-3  # the adapters learned an update the mask changes


def test_an_adapter_declared_n_m_or_merged_before_is_refused_by_name():
    torch.manual_seed(0)
    model = tiny_llama(transformers)
    magnitude_2_4(model)
    lora = peft.get_peft_model(model.eval(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    nmcompile.annotate(lora, {"*lora_B*": "asp:2:4,permute=0", "*": "asp:2:4,permute=0"}, default_dense=[])
    with pytest.raises(Exception, match=r"q_proj.lora_[AB].default.weight is a LoRA adapter weight declared N:M"):
        torch.compile(lora, backend="nmsparse", options={"inner": "aot_eager"})(input_ids=IDS)
    lora = peft.get_peft_model(tiny_llama(transformers).eval(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    lora.merge_adapter()
    with pytest.raises(ValueError, match=r"was merged already .*unmerge_adapter\(\) first"):
        merge_adapters(lora)
    dora = peft.get_peft_model(tiny_llama(transformers).eval(), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                                use_dora=True))
    with pytest.raises(ValueError, match=r"q_proj is a DoRA adapter \(use_dora=True\)"):
        merge_adapters(dora)
    with pytest.raises(ValueError, match="has no peft LoRA layer"):
        merge_adapters(tiny_llama(transformers))


def test_the_pass_leaves_a_graph_without_adapters_alone():
    assert mask_adapter_updates(torch.fx.symbolic_trace(torch.nn.Linear(4, 4)), type("Ctx", (), {"targets": []})()) == 0
