"""Mixtures of experts saved and loaded back (issue 52, row 1).

transformers 5 holds a Mixtral's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``)
and ``save_pretrained`` writes them as the Hub's checkpoints hold them, one Linear weight per expert
(``block_sparse_moe.experts.{e}.w1/w3/w2.weight``); the router ``mlp.gate`` becomes ``block_sparse_moe.gate``.
The layout record named weights that no file held: ``nmcompile check DIR`` stopped and the packed load refused
the directory. Now the record says which file tensors hold each weight (``saved``), ``check`` checks those, and
``load_pretrained`` builds the model's weights from them as ``from_pretrained`` does. The end-to-end runs through
``nmcompile prune`` (one-pass and sequential, fused and per-expert experts) are in tests/app/test_prune.py.
"""

import json

import pytest
import torch

import nmcompile
from nmcompile.checkpoint import conversions
from nmcompile.deploy import PackedLinearWeight, load_pretrained, save_pretrained
from nmcompile.kernels import cpu24
from models import magnitude_2_4, per_expert_moe_classes, tiny_moe

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
kernel = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")

EXPERTS = ("gate_up_proj", "down_proj")


def pruned_mixtral():
    """A tiny Mixtral, every expert and attention weight 2:4 by magnitude, finalized (the router and head dense)."""
    torch.manual_seed(0)
    model = tiny_moe(transformers, "mixtral")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.copy_(nmcompile.masks.prune(p, 2, 4, -1))
    magnitude_2_4(model)
    return model


def saved_mixtral(tmp_path):
    model = pruned_mixtral()
    with pytest.warns(UserWarning, match="model_packed.pt was not written: .*3-D weight"):
        save_pretrained(model, tmp_path / "mixtral")
    return model, tmp_path / "mixtral"


def file_names(layer: int, w: str) -> list[str]:
    return [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4)]


def rewrite(path, change) -> None:
    """``change(tensors)`` applied to the directory's model.safetensors (its metadata kept)."""
    file = path / "model.safetensors"
    from safetensors import safe_open

    with safe_open(file, "pt") as handle:
        metadata = handle.metadata()
    tensors = safetensors_torch.load_file(file)
    change(tensors)
    safetensors_torch.save_file(tensors, file, metadata=metadata)


@kernel
def test_a_saved_mixtral_checks_its_expert_files_and_loads_packed_and_dense(tmp_path):
    model, path = saved_mixtral(tmp_path)
    record = json.loads((path / "nmcompile.json").read_text())
    saved = record["saved"]
    for layer in range(2):
        assert saved[f"model.layers.{layer}.mlp.experts.gate_up_proj"] == [
            name for pair in zip(file_names(layer, "w1"), file_names(layer, "w3")) for name in pair]
        assert saved[f"model.layers.{layer}.mlp.experts.down_proj"] == file_names(layer, "w2")
        assert saved[f"model.layers.{layer}.mlp.gate.weight"] == [f"model.layers.{layer}.block_sparse_moe.gate.weight"]
    report = nmcompile.check(path)  # what `nmcompile check DIR` prints
    assert report.ok and len(report) == 2 * (4 + 12)
    assert all(report[name].dim == 1 for layer in range(2) for w in ("w1", "w2", "w3") for name in file_names(layer, w))
    assert "dense in the layout record (model.layers.0.mlp.gate.weight as the model holds it)" in \
        report.skipped["model.layers.0.block_sparse_moe.gate.weight"]

    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
    with pytest.warns(UserWarning, match=r"held dense.*model.layers.0.mlp.experts.gate_up_proj \(a 3-D weight"):
        packed = load_pretrained(path, packed=True, measure=False)
    held = [n for n, p in packed.named_parameters() if isinstance(p, PackedLinearWeight)]
    assert len(held) == 8 and all("self_attn" in n for n in held)  # the fused experts: dense, and said so
    dense = load_pretrained(path)
    for loaded in (packed, dense):
        check = nmcompile.check(loaded)
        assert check.ok and set(check) == set(nmcompile.check(model))
        assert all(check[f"model.layers.{i}.mlp.experts.{w}"].dim == -1 for i in range(2) for w in EXPERTS)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


@kernel
def test_an_expert_file_that_is_not_2_4_is_named_by_check_and_load(tmp_path):
    _, path = saved_mixtral(tmp_path)
    bad = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite(path, lambda tensors: tensors[bad].fill_(1.0))
    report = nmcompile.check(path)
    assert not report.ok and [n for n, c in report.items() if not c.ok] == [bad]
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.gate_up_proj, built from "
                                         r"model.layers.1.block_sparse_moe.experts.0.w1.weight.*: \d+/\d+ groups "
                                         r"along dim -1 are not 2:4"):
        load_pretrained(path, packed=True, measure=False)


def test_a_missing_expert_file_is_named(tmp_path):
    _, path = saved_mixtral(tmp_path)
    gone = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    rewrite(path, lambda tensors: tensors.pop(gone))
    with pytest.raises(ValueError, match=r"no weights file holds: model.layers.0.mlp.experts.down_proj \(written as "
                                         + gone.replace(".", r"\.")):
        nmcompile.check(path)


@kernel
def test_a_directory_saved_before_the_record_named_the_expert_files(tmp_path):
    """Written by an earlier nmcompile (no ``saved``): the packed load finds the expert files by transformers'
    own rules; check says how to write the record again."""
    model, path = saved_mixtral(tmp_path)
    record = json.loads((path / "nmcompile.json").read_text())
    del record["saved"]
    (path / "nmcompile.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="no weights file holds: model.layers.0.mlp.experts.gate_up_proj.*save it again "
                                         "with nmcompile.deploy.save_pretrained"):
        nmcompile.check(path)
    with pytest.warns(UserWarning, match="held dense"):
        packed = load_pretrained(path, packed=True, measure=False)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    resaved = tmp_path / "again"
    with pytest.warns(UserWarning, match="model_packed.pt was not written"):
        save_pretrained(load_pretrained(path), resaved)
    assert nmcompile.check(resaved).ok


# a model whose checkpoints transformers converts into 2-D Linear weights: the per-expert model with each block's
# `mix` Linear written as two halves of its rows (as transformers splits a fused gate_up_proj or qkv on save)


def split_mix_model():
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, WeightConverter

    config_class, model_class = per_expert_moe_classes(transformers, "nmcompile_split_mix_moe")
    register_checkpoint_conversion_mapping(config_class.model_type, [WeightConverter(
        source_patterns=["mix_top.weight", "mix_bottom.weight"], target_patterns="mix.weight",
        operations=[Concatenate(dim=0)])], overwrite=True)
    torch.manual_seed(0)
    return model_class(config_class())


@kernel
def test_a_weight_transformers_writes_in_parts_is_packed_when_loaded(tmp_path):
    model = split_mix_model().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.1)
    magnitude_2_4(model)
    save_pretrained(model, tmp_path / "split")
    names = json.loads((tmp_path / "split" / "nmcompile.json").read_text())["saved"]
    assert sorted(names["layers.0.mix.weight"]) == ["layers.0.mix_bottom.weight", "layers.0.mix_top.weight"]
    report = nmcompile.check(tmp_path / "split")
    assert report.ok and report["layers.0.mix_top.weight"].dim == 1 and "layers.0.mix.weight" not in report
    packed = load_pretrained(tmp_path / "split", packed=True, measure=False)
    mix = packed.layers[0].mix.weight
    assert isinstance(mix, PackedLinearWeight) and torch.equal(mix.dense(), model.layers[0].mix.weight)
    assert nmcompile.check(packed).ok and set(nmcompile.check(packed)) == set(nmcompile.check(model))
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_part_dims_follow_the_reduction_dim_from_the_end():
    assert conversions.part_dim((4, 64, 32), -1, (32, 32)) == 1  # an expert's w1 of a fused gate_up_proj
    assert conversions.part_dim((64, 32), 1, (32, 32)) == 1  # a row half of a Linear weight
    assert conversions.part_dim((64, 32), 0, (32, 32)) is None  # a half of the reduction dim: not checkable alone
    assert conversions.part_dim((4, 64, 32), -1, (32, 16)) is None  # a split of the reduction dim
