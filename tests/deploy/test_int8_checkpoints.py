"""Directories of models whose 2:4 weights hold int8 values: ``save_pretrained`` writes the codes, positions and
row scales (``model_int8.safetensors``) beside dense files of the dequantized weights; ``load_pretrained(packed=
True)`` reads the codes straight into int8 packed weights (and the head as int8 rows); a plain ``from_pretrained``
still gives the working model; ``nmcompile check DIR`` checks the codes against the dense files."""

import json
import os
import subprocess
import sys

import pytest
import torch

from nmcompile.checkpoint import loading
from nmcompile.checkpoint.file_checks import check_path
from nmcompile.checkpoint.weight_files import SafetensorsFile, write_safetensors
from nmcompile.deploy import load_pretrained, pack_weights, save_pretrained, unpack_weights
from nmcompile.kernels import cpu24
from nmcompile.state import records
from models import _gpt2, magnitude_2_4, tiny_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel: {cpu24.status().reason}")

IDS = torch.tensor([[1, 5, 9, 77, 3, 120, 4, 8]])


def _int8_model(kind):
    """A magnitude-pruned model held as 2:4 int8 (head int8 rows), its output, and the packed int8 weights."""
    torch.manual_seed(0)
    model = _gpt2(transformers) if kind == "gpt2" else tiny_llama(transformers)
    magnitude_2_4(model)
    model.eval()
    pack_weights(model, bits=8, measure=False)
    with torch.no_grad():
        out = model(IDS).logits
    held = {name: p for name, p in model.named_parameters() if getattr(p, "quantized", False) and not p.dense_rows}
    return model, out, {name: (p.values.clone(), p.scales.clone()) for name, p in held.items()}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def saved(request, tmp_path_factory):
    model, out, codes = _int8_model(request.param)
    unpack_weights(model)  # the dequantized weights, each grid recorded
    directory = tmp_path_factory.mktemp(f"int8-{request.param}") / "out"
    save_pretrained(model, directory)
    return request.param, directory, out, codes


def test_the_directory_holds_the_codes_and_the_record_marks_them(saved):
    kind, directory, _, codes = saved
    record = json.loads((directory / "nmcompile.json").read_text())
    assert record["int8"] == {"file": "model_int8.safetensors"}
    assert {name for name, w in record["weights"].items() if w.get("bits") == 8} == set(codes) == set(record["weights"])
    file = SafetensorsFile(directory / "model_int8.safetensors")
    name = next(iter(codes))
    out_f, in_f = record["weights"][name]["shape"][::-1] if kind == "gpt2" else record["weights"][name]["shape"]
    assert (file.dtype(f"{name}.codes"), file.shape(f"{name}.codes")) == (torch.int8, (out_f, in_f // 2))
    assert (file.dtype(f"{name}.meta"), file.shape(f"{name}.meta")) == (torch.int16, (out_f, in_f // 16))
    assert (file.dtype(f"{name}.scales"), file.shape(f"{name}.scales")) == (torch.float32, (out_f,))
    dense_bytes = sum(torch.Size(w["shape"]).numel() * 4 for w in record["weights"].values())  # fp32 model
    payload = sum(end - begin for _, _, begin, end in file.entries.values())
    # 8 bits for half the positions, 2 bits of position per group of 4, 4 bytes of scale per row
    assert payload == sum(s[0] * s[1] * 5 // 8 + s[0] * 4 for s in (
        torch.Size(w["shape"][::-1] if kind == "gpt2" else w["shape"]) for w in record["weights"].values()))
    assert payload < 0.2 * dense_bytes
    assert check_path(directory, None, None, None).ok


def test_a_packed_load_reads_the_codes_and_runs_as_the_int8_model_did(saved, monkeypatch):
    _, directory, out, codes = saved
    read = []
    monkeypatch.setattr(loading, "read_packed", lambda source, key, *a: read.append(key) or _fail())
    model = load_pretrained(directory, packed=True, measure=False)
    assert not read  # every 2:4 weight came from the int8 file; the dense copies were not read
    params = dict(model.named_parameters())
    for name, (values, scales) in codes.items():
        p = params[name]
        assert p.quantized and torch.equal(p.values, values) and torch.equal(p.scales, scales)
        assert torch.equal(records.get(model.get_submodule(name.rsplit(".", 1)[0]), records.INT8, "weight"), scales)
    head = model.get_output_embeddings().weight
    assert head.quantized and head.dense_rows
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, out, rtol=1e-5, atol=1e-5)
    kept = load_pretrained(directory, packed=True, measure=False, head=None)
    assert not getattr(kept.get_output_embeddings().weight, "quantized", False)


def test_a_plain_load_is_the_dequantized_model_and_packs_on_the_same_grid(saved):
    kind, directory, out, codes = saved
    plain = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    with torch.no_grad():  # float weights: the int8 kernel's sums in another order, and a float head
        torch.testing.assert_close(plain(IDS).logits, out, rtol=1e-3, atol=1e-3)
    model = load_pretrained(directory, measure=False)
    decisions = pack_weights(model, measure=False)  # bits left out: the recorded grids are int8
    params = dict(model.named_parameters())
    for name, (values, scales) in codes.items():
        assert "int8 grid" in decisions[name].reason
        assert torch.equal(params[name].values, values) and torch.equal(params[name].scales, scales)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, out, rtol=1e-5, atol=1e-5)


def test_a_fresh_process_loads_the_directory_packed(saved):
    kind, directory, out, _ = saved
    if kind != "llama":
        pytest.skip("one architecture is enough for the fresh process")
    torch.save(out, directory.parent / "expected.pt")
    script = (
        "import sys, torch\n"
        "from nmcompile.deploy import load_pretrained\n"
        f"model = load_pretrained({str(directory)!r}, packed=True, measure=False)\n"
        "w = model.model.layers[0].mlp.down_proj.weight\n"
        "assert w.quantized, w\n"
        f"with torch.no_grad(): got = model(torch.tensor({IDS.tolist()})).logits\n"
        f"torch.testing.assert_close(got, torch.load({str(directory.parent / 'expected.pt')!r}), rtol=1e-5, atol=1e-5)\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_codes_that_are_not_the_dense_weights_fail_the_check_and_a_missing_file_is_named(saved, tmp_path):
    _, directory, _, codes = saved
    copy = tmp_path / "copy"
    copy.mkdir()
    for entry in os.listdir(directory):
        (copy / entry).write_bytes((directory / entry).read_bytes())
    file = SafetensorsFile(copy / "model_int8.safetensors")
    name = next(iter(codes))
    tensors = {key: file.read(key) for key in file.keys()}
    tensors[f"{name}.scales"] = tensors[f"{name}.scales"] * 1.5  # another save's grid, say
    write_safetensors(copy / "model_int8.safetensors", [(k, t.dtype, t.shape, lambda t=t: t) for k, t in tensors.items()])
    report = check_path(copy, None, None, None)
    assert not report.ok and "not the int8 codes" in report[name].problem
    assert all(report[other].ok for other in codes if other != name)
    os.remove(copy / "model_int8.safetensors")
    with pytest.raises(ValueError, match=r"hold int8 values in model_int8.safetensors, which is missing"):
        load_pretrained(copy, packed=True, measure=False)
    assert "which is missing" in check_path(copy, None, None, None)[name].problem


def test_a_weight_moved_off_its_grid_is_refused_by_name(tmp_path):
    model, _, codes = _int8_model("llama")
    unpack_weights(model)
    name = next(iter(codes))
    with torch.no_grad():
        dict(model.named_parameters())[name].mul_(1.37)  # trained on after it was quantized, say
    with pytest.raises(ValueError, match=rf"kept values of {name} are not on the int8 grid recorded for it"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def _fail():
    raise AssertionError("a 2:4 weight with int8 values was read from the dense files")


def test_a_head_named_where_it_cannot_apply_is_refused_not_ignored(saved, tmp_path):
    kind, directory, _, _ = saved
    head = "lm_head"
    with pytest.raises(ValueError, match=r"head='lm_head'.*loaded dense and its weights hold int8 values"):
        load_pretrained(directory, head=head)  # dense: the head stays as stored
    float_model = tiny_llama(transformers)
    magnitude_2_4(float_model)
    save_pretrained(float_model, tmp_path / "float")
    with pytest.raises(ValueError, match=r"loaded packed and its weights hold float values.*pack_weights"):
        load_pretrained(tmp_path / "float", packed=True, head=head)
    load_pretrained(tmp_path / "float", packed=True, measure=False)  # the default ("auto") applies where it can


def test_a_bf16_model_saves_and_loads_its_exact_codes(tmp_path):
    """bf16 rounds code times scale by up to 0.496 steps (codes near 127): still nearest to its own code, so the
    dense bf16 weights give the codes back exactly."""
    torch.manual_seed(0)
    model = tiny_llama(transformers).to(torch.bfloat16).eval()
    magnitude_2_4(model)
    pack_weights(model, bits=8, measure=False, head=None)
    held = {n: (p.values.clone(), p.scales.clone()) for n, p in model.named_parameters() if getattr(p, "quantized", False)}
    unpack_weights(model)
    save_pretrained(model, tmp_path / "bf16")
    loaded = load_pretrained(tmp_path / "bf16", packed=True, measure=False, head=None)
    got = {n: (p.values, p.scales) for n, p in loaded.named_parameters() if getattr(p, "quantized", False)}
    assert set(got) == set(held)
    for name, (values, scales) in held.items():
        assert torch.equal(got[name][0], values) and torch.equal(got[name][1], scales), name
    assert check_path(tmp_path / "bf16", None, None, None).ok
