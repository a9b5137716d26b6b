"""``nmcompile.check`` of a model directory and of its files: each weight along its recorded dim; without a
record, a failed check says which ``dim`` and ``only`` fit the file."""

import json
import os

import pytest
import torch

import nmcompile
from nmcompile.deploy import save_pretrained
from models import _gpt2, magnitude_2_4, tiny_llama

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture
def gpt2_dir(tmp_path):
    torch.manual_seed(0)
    model = _gpt2(transformers)
    magnitude_2_4(model)
    save_pretrained(model, tmp_path / "gpt2")
    return tmp_path / "gpt2"


def test_a_directory_and_its_files_are_checked_with_the_record(gpt2_dir):
    for path in (gpt2_dir, gpt2_dir / "model.safetensors", gpt2_dir / "model_packed.pt"):
        report = nmcompile.check(path)
        assert report.ok and len(report) == 8, (path, str(report))
        assert {c.dim for c in report.values()} == {0}
        assert "embeddings are never sparsified" in report.skipped["transformer.wte.weight"]
    assert "dense in the layout record" in str(nmcompile.check(gpt2_dir))
    other = gpt2_dir / "mine.pt"  # a file of the user's beside the record: not described by it
    torch.save({"fc.weight": nmcompile.masks.prune(torch.randn(8, 16), 2, 4, 1)}, other)
    assert nmcompile.check(other).ok and nmcompile.check(other)["fc.weight"].dim == 1
    os.remove(gpt2_dir / "nmcompile.json")  # the safetensors metadata carries the same record
    assert nmcompile.check(gpt2_dir).ok and nmcompile.check(gpt2_dir / "model.safetensors").ok
    assert nmcompile.check(gpt2_dir, only="*.mlp.*").keys() == {f"transformer.h.{i}.mlp.{n}.weight" for i in (0, 1)
                                                                 for n in ("c_fc", "c_proj")}


def test_a_recorded_weight_that_is_dense_or_missing_fails(gpt2_dir):
    state = safetensors_torch.load_file(gpt2_dir / "model.safetensors")
    metadata = {"format": "pt", "nmcompile": json.dumps(json.loads((gpt2_dir / "nmcompile.json").read_text()))}
    state["transformer.h.1.mlp.c_fc.weight"] = torch.ones_like(state["transformer.h.1.mlp.c_fc.weight"])
    safetensors_torch.save_file(state, gpt2_dir / "model.safetensors", metadata=metadata)
    report = nmcompile.check(gpt2_dir)
    assert not report.ok and report["transformer.h.1.mlp.c_fc.weight"].violations == 1024
    del state["transformer.h.0.attn.c_attn.weight"]
    safetensors_torch.save_file(state, gpt2_dir / "model.safetensors", metadata=metadata)
    with pytest.raises(ValueError, match="names N:M weights that no weights file holds: transformer.h.0.attn.c_attn"):
        nmcompile.check(gpt2_dir)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_without_a_record_the_hint_fits_the_file(tmp_path, kind):
    torch.manual_seed(0)
    model = _gpt2(transformers) if kind == "gpt2" else tiny_llama(transformers)
    magnitude_2_4(model)
    path = tmp_path / "plain.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
                                 or kind == "llama"}, path)
    report = nmcompile.check(path)
    assert not report.ok
    if kind == "gpt2":
        assert "8 of 10 tensors are 2:4 along dim 0" in report.hint and "Conv1D" in report.hint
        assert report.hint.endswith(f"nmcompile check {path} --dim 0 --only 'transformer.h.*'")
        fixed = nmcompile.check(path, dim=0, only="transformer.h.*")
    else:
        assert "14 of 16 tensors are 2:4 along dim 1" in report.hint
        assert report.hint.endswith(f"nmcompile check {path} --only 'model.layers.*'")
        fixed = nmcompile.check(path, only="model.layers.*")
    assert fixed.ok and len(fixed) == (8 if kind == "gpt2" else 14)
    safetensors_torch.save_file({"w": torch.randn(8, 16), "v": torch.randn(16, 8)}, tmp_path / "dense.safetensors")
    assert "no tensor of" in nmcompile.check(tmp_path / "dense.safetensors").hint
    assert "weights are dense" in nmcompile.check(tmp_path / "dense.safetensors").hint


def test_a_directory_without_weights_files_says_what_it_reads(tmp_path):
    with pytest.raises(ValueError, match="holds no weights file that nmcompile check reads"):
        nmcompile.check(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(ValueError, match="not a safetensors file"):
        nmcompile.check(tmp_path)
