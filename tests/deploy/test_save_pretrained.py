"""``nmcompile.deploy.save_pretrained``: a finalized model's directory records its N:M layout, and its packed
file holds every 2:4 weight packed (GPT-2's Conv1D as its transpose), smaller than the safetensors file."""

import json
import os
import shutil

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile.deploy import Layout, layout_of, read_layout, save_pretrained, unpack_state_dict
from nmcompile.checkpoint.weight_files import SafetensorsFile, safetensors_metadata, stamp_safetensors
from models import _gpt2, magnitude_2_4, tiny_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(params=["gpt2", "llama"])
def deployed(request):
    torch.manual_seed(0)
    model = _gpt2(transformers) if request.param == "gpt2" else tiny_llama(transformers)
    magnitude_2_4(model)
    return request.param, model


def test_the_directory_records_each_weight_s_pattern_and_dim(tmp_path, deployed):
    kind, model = deployed
    files = save_pretrained(model, tmp_path / "out")
    names = {os.path.basename(f) for f in files}
    assert {"config.json", "model.safetensors", "model_packed.pt", "nmcompile.json"} <= names
    record = json.loads((tmp_path / "out" / "nmcompile.json").read_text())
    assert record["format"] == "nmcompile-layout" and record["version"] == 1 and record["nmcompile"] == nmcompile.__version__
    if kind == "gpt2":
        assert len(record["weights"]) == 8
        assert record["weights"]["transformer.h.0.attn.c_attn.weight"] == {"pattern": "2:4", "dim": 0, "shape": [32, 96]}
        assert record["tied"] == {"lm_head.weight": "transformer.wte.weight"}
        assert "embeddings are never sparsified" in record["dense"]["transformer.wte.weight"]
    else:
        assert len(record["weights"]) == 14
        assert record["weights"]["model.layers.0.mlp.down_proj.weight"] == {"pattern": "2:4", "dim": 1, "shape": [64, 128]}
        assert record["tied"] == {} and set(record["dense"]) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert record["packed"] == {"file": "model_packed.pt"}
    # the same record in the safetensors metadata, which HF's own keys keep
    metadata = safetensors_metadata(tmp_path / "out" / "model.safetensors")
    assert json.loads(metadata["nmcompile"]) == record and metadata["format"] == "pt"
    assert read_layout(tmp_path / "out").weights == layout_of(model).weights


def test_the_packed_file_is_packed_for_every_layout_and_smaller(tmp_path, deployed):
    kind, model = deployed
    save_pretrained(model, tmp_path / "out")
    packed_path = tmp_path / "out" / "model_packed.pt"
    state = torch.load(packed_path, weights_only=True)
    layout = read_layout(tmp_path / "out")
    assert all(name + ".nm24_meta" in state for name in layout.weights)
    assert packed_path.stat().st_size < (tmp_path / "out" / "model.safetensors").stat().st_size
    if kind == "gpt2":  # [in, out] packed as its transpose: values [out, in/2]
        assert state["transformer.h.0.attn.c_attn.weight"].shape == (96, 16)
        assert state._metadata["nmcompile.nm24"]["transposed"] == sorted(layout.weights, key=list(state).index)
    expected = model.state_dict()
    restored = unpack_state_dict(state)
    assert restored.keys() == expected.keys()
    assert all(torch.equal(restored[k], expected[k]) for k in expected)
    assert nmcompile.check(packed_path).ok  # packed entries are checked along the dim they were packed along


def test_save_refuses_a_model_without_a_finalized_weight_and_names_what_is_not_packed(tmp_path):
    with pytest.raises(ValueError, match="no finalized N:M weight.*nmcompile.finalize"):
        save_pretrained(tiny_llama(transformers), tmp_path / "plain")
    assert not (tmp_path / "plain").exists()
    model = nn.Sequential(nn.Linear(24, 8), nn.Linear(8, 4))  # a reduction dim of 24: 2:4, not packable
    with torch.no_grad():
        model[0].weight.copy_(nmcompile.masks.prune(model[0].weight, 2, 4, 1))
    nmcompile.finalize(model, pattern="2:4")
    with pytest.warns(UserWarning, match=r"model_packed.pt was not written: 0.weight's reduction dim \(24\)"):
        files = save_pretrained(model, tmp_path / "seq")
    assert sorted(os.path.basename(f) for f in files) == ["model.pt", "nmcompile.json"]
    record = json.loads((tmp_path / "seq" / "nmcompile.json").read_text())
    assert record["packed"] == {"file": None, "why": "0.weight's reduction dim (24) is not a multiple of 16"}
    assert record["dense"] == {"1.weight": "not declared or finalized 2:4"}


def test_a_packed_file_that_would_not_fit_in_memory_is_not_written_and_says_why(tmp_path, monkeypatch):
    from nmcompile.checkpoint import saving
    from nmcompile.state import memory

    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    for layer in model:
        with torch.no_grad():
            layer.weight.copy_(nmcompile.masks.prune(layer.weight, 2, 4, 1))
    nmcompile.finalize(model, pattern="2:4")
    need = 32 * 64 * 4 // 2 + 32 * 64 // 8 + 16 * 32 * 4 // 2 + 16 * 32 // 8  # fp32 values + int16 words
    assert saving._packed_bytes(model, layout_of(model)) == need
    monkeypatch.setattr(memory, "available_bytes", lambda: 2 * need)  # exactly half: written
    assert "model_packed.pt" in {os.path.basename(f) for f in save_pretrained(model, tmp_path / "fits")}
    monkeypatch.setattr(memory, "available_bytes", lambda: 2 * need - 1)
    with pytest.warns(UserWarning, match=r"model_packed.pt was not written: its 0.0 GB of packed weights.*"
                                         r"load_pretrained\(DIR, packed=True\)"):
        files = save_pretrained(model, tmp_path / "big")
    assert sorted(os.path.basename(f) for f in files) == ["model.pt", "nmcompile.json"]
    record = json.loads((tmp_path / "big" / "nmcompile.json").read_text())
    assert record["packed"]["file"] is None and "more than half" in record["packed"]["why"]


def test_a_disk_too_small_is_refused_before_anything_is_written_and_the_packed_file_yields_first(
        tmp_path, monkeypatch):
    """A save needs the weights plus its largest safetensors file again (stamping the layout writes it
    again): short of that it writes nothing and says how much; with room for the safetensors files but
    not the packed one, the packed file is skipped with the reason recorded."""
    from nmcompile.checkpoint import saving

    torch.manual_seed(0)
    model = tiny_llama(transformers)
    magnitude_2_4(model)
    weights = saving._state_bytes(model)
    assert weights == sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    packed = saving._packed_bytes(model, layout_of(model))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    disk = {"size": 0}

    def free(directory):  # a disk of disk["size"] bytes holding what is under tmp_path
        return disk["size"] - sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())

    monkeypatch.setattr(saving, "_free_bytes", free)
    disk["size"] = 2 * weights - 1
    with pytest.raises(OSError, match=r"needs about 0.0 GB of disk .* and that disk has 0.0 GB free"):
        save_pretrained(model, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and os.listdir(tmp_path / "out") == ["notes.txt"]
    disk["size"] = 2 * weights + packed + 4  # the config files written beside the weights take the margin
    with pytest.warns(UserWarning, match=r"model_packed.pt was not written: .* do not fit in the 0.0 GB of disk"):
        files = save_pretrained(model, tmp_path / "out")
    assert "model_packed.pt" not in {os.path.basename(f) for f in files}
    assert "disk" in json.loads((tmp_path / "out" / "nmcompile.json").read_text())["packed"]["why"]
    shutil.rmtree(tmp_path / "out")
    disk["size"] = 2 * weights + packed + 100_000
    assert "model_packed.pt" in {os.path.basename(f) for f in save_pretrained(model, tmp_path / "out")}
    monkeypatch.setattr(saving, "_free_bytes", lambda directory: weights)  # model.pt: no file written again
    saving.check_disk(model, tmp_path / "pt", hf=False)
    with pytest.raises(OSError, match="needs about"):
        saving.check_disk(model, tmp_path / "pt", hf=True)


def test_a_save_writes_safetensors_files_of_at_most_the_shard_size_unless_told(tmp_path, monkeypatch):
    from nmcompile.checkpoint import saving

    torch.manual_seed(0)
    model = tiny_llama(transformers)
    magnitude_2_4(model)
    monkeypatch.setattr(saving, "SHARD_SIZE", "200KB")
    save_pretrained(model, tmp_path / "small")
    assert len(list((tmp_path / "small").glob("model-*.safetensors"))) > 1
    save_pretrained(model, tmp_path / "one", max_shard_size="50GB")
    assert [p.name for p in (tmp_path / "one").glob("*.safetensors")] == ["model.safetensors"]


def test_the_disk_check_counts_the_largest_file_the_save_will_write(tmp_path, monkeypatch):
    from nmcompile.checkpoint import saving

    torch.manual_seed(0)
    model = tiny_llama(transformers)
    magnitude_2_4(model)
    weights = saving._state_bytes(model)
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    assert 2 * largest < weights
    assert [saving._size_bytes(s) for s in (123, "5GB", "0.5 mb", "20KB", "5GiB")] == [123, 5 * 10**9, 500_000, 20_000, None]
    monkeypatch.setattr(saving, "_free_bytes", lambda directory: weights + largest)
    saving.check_disk(model, tmp_path / "a", shard_size=1000)  # files of one tensor each: the largest is written again
    for size in ("50GB", "5GiB"):  # one file of everything; a size it cannot read: the whole state, to be safe
        with pytest.raises(OSError, match=r"plus one file of up to"):
            saving.check_disk(model, tmp_path / "a", shard_size=size)
    with pytest.raises(OSError, match="needs about"):
        save_pretrained(model, tmp_path / "b", max_shard_size="50GB")
    assert not (tmp_path / "b").exists()


def test_a_save_into_an_earlier_save_replaces_it_whole(tmp_path):
    torch.manual_seed(0)
    model = tiny_llama(transformers)
    magnitude_2_4(model)
    out = tmp_path / "out"
    save_pretrained(model, out, max_shard_size="200KB")
    assert (out / "model.safetensors.index.json").exists() and not (out / "model.safetensors").exists()
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and all("nmcompile" in safetensors_metadata(out / s) for s in shards)
    assert nmcompile.check(out).ok and len(nmcompile.check(out)) == 14  # every shard read
    assert nmcompile.check(out / shards[0]).ok  # one shard: the weights it holds
    from nmcompile.kernels import cpu24

    if cpu24.status().available:  # a packed load reads every shard
        assert nmcompile.check(nmcompile.deploy.load_pretrained(out, packed=True)).ok
    (out / "notes.txt").write_text("mine")
    save_pretrained(model, out)
    assert (out / "model.safetensors").exists() and not list(out.glob("model-*.safetensors"))
    assert not (out / "model.safetensors.index.json").exists() and (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not the staging folder's 0700


@pytest.mark.parametrize("fails", ["a file", "the last rename"])
def test_a_save_that_fails_into_an_earlier_one_leaves_it_untouched(tmp_path, monkeypatch, fails):
    torch.manual_seed(0)
    first = tiny_llama(transformers)
    magnitude_2_4(first)
    out = tmp_path / "out"
    save_pretrained(first, out)
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    torch.manual_seed(1)
    second = tiny_llama(transformers)
    magnitude_2_4(second)
    real_replace = os.replace

    def replace(src, dst):  # a file that cannot be replaced, or the folder's own rename refused
        if (fails == "a file" and os.path.basename(dst) == "nmcompile.json") or \
                (fails == "the last rename" and os.fspath(dst) == os.fspath(out) and "partial" in os.fspath(src)):
            raise PermissionError(13, "Permission denied", dst)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    try:
        save_pretrained(second, out)
    except PermissionError:
        pass
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    if fails == "a file":  # no file is replaced one by one: the save went through whole
        assert after.keys() == before.keys() and after["notes.txt"] == b"mine"
        loaded = nmcompile.deploy.load_pretrained(out)
        assert torch.equal(loaded.model.layers[0].mlp.down_proj.weight, second.model.layers[0].mlp.down_proj.weight)
    else:  # the earlier save, whole: A's weights beside A's packed file and record
        assert after == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_stamping_metadata_keeps_every_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, 16).bfloat16()}
    save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "pt"})
    stamp_safetensors(tmp_path / "t.safetensors", {"nmcompile": "{}"})
    back = load_file(tmp_path / "t.safetensors")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert safetensors_metadata(tmp_path / "t.safetensors") == {"format": "pt", "nmcompile": "{}"}
    reader = SafetensorsFile(tmp_path / "t.safetensors")
    assert torch.equal(reader.read("c", (1, 2)), tensors["c"][1:2]) and torch.equal(reader.read("b"), tensors["b"])


def test_a_record_from_a_newer_nmcompile_or_damaged_is_named(tmp_path):
    (tmp_path / "nmcompile.json").write_text(json.dumps({"format": "nmcompile-layout", "version": 9, "weights": {}}))
    with pytest.raises(ValueError, match="layout record version 9.*upgrade nmcompile"):
        read_layout(tmp_path)
    (tmp_path / "nmcompile.json").write_text("{")
    with pytest.raises(ValueError, match="nmcompile.json: not a readable JSON layout record"):
        read_layout(tmp_path)
    bad = {"format": "nmcompile-layout", "version": 1, "weights": {"w": {"pattern": "5:4", "dim": 1, "shape": [4]}}}
    with pytest.raises(ValueError, match="the entry of 'w'.*invalid N:M pattern 5:4"):
        Layout.from_json(bad, "here")
