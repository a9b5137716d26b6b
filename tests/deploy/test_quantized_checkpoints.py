"""Directories of models whose 2:4 weights hold int8 or 4-bit values: ``save_pretrained`` writes the codes,
positions and scales (``model_int8.safetensors``: row scales; ``model_int4.safetensors``: group scales) beside
dense files of the dequantized weights; ``load_pretrained(packed=True)`` reads the codes straight into packed
weights of that width (and the head as rows of it); a plain ``from_pretrained`` still gives the working model;
``nmcompile check DIR`` checks the codes against the dense files."""

import json
import os
import subprocess
import sys

import pytest
import torch

from nmcompile.checkpoint import loading
from nmcompile.checkpoint.file_checks import check_path
from nmcompile.checkpoint.quantized_weights import FILES, WIDTHS
from nmcompile.checkpoint.weight_files import SafetensorsFile, write_safetensors
from nmcompile.deploy import load_pretrained, pack_weights, save_pretrained, unpack_weights
from nmcompile.kernels import cpu24
from nmcompile.state import records
from models import _gpt2, magnitude_2_4, tiny_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel: {cpu24.status().reason}")

IDS = torch.tensor([[1, 5, 9, 77, 3, 120, 4, 8]])


def _gpt2_64():
    """A GPT-2 whose Conv1D weights' reduction dims (64, 256) are multiples of the 4-bit group."""
    config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def _model(kind, bits):
    """A magnitude-pruned model held as 2:4 with ``bits``-bit values (head rows of that width), its output, and
    the packed weights' ``(values, positions, scales, dense weight)``."""
    if bits == 4 and "avx2" not in cpu24.isas():
        pytest.skip("4-bit values run on the AVX2 kernel")
    torch.manual_seed(0)
    model = (_gpt2(transformers) if bits == 8 else _gpt2_64()) if kind == "gpt2" else tiny_llama(transformers)
    magnitude_2_4(model)
    model.eval()
    pack_weights(model, bits=bits, measure=False)
    with torch.no_grad():
        out = model(IDS).logits
    held = {name: p for name, p in model.named_parameters() if getattr(p, "quantized", False) and not p.dense_rows}
    return model, out, {name: (p.values.clone(), p.bits.clone(), p.scales.clone(), p.dense()) for name, p in held.items()}


def _same(p, held) -> bool:
    """Whether packed ``p`` holds the weight of ``held``: the same codes, positions and scales; with 4-bit values
    a kept value whose code is 0 may sit at another position of its group of 4 (the dense files do not say which
    of the group's zeros was kept), so the same scales and the same dense weight."""
    values, positions, scales, dense = held
    same = torch.equal(p.values, values) and torch.equal(p.bits, positions) if not p.int4 else torch.equal(p.dense(), dense)
    return same and torch.equal(p.scales, scales)


def _grid(p):
    """The grid record of a packed weight: int8 row scales, or 4-bit group scales ``[out, in/group]``."""
    return p.scales if not p.int4 else p.scales.transpose(1, 2).reshape(-1, p.scales.shape[1])[:p.weight_shape[0]]


@pytest.fixture(scope="module", params=[("llama", 8), ("gpt2", 8), ("llama", 4), ("gpt2", 4)], ids=str)
def saved(request, tmp_path_factory):
    kind, bits = request.param
    model, out, codes = _model(kind, bits)
    unpack_weights(model)  # the dequantized weights, each grid recorded
    directory = tmp_path_factory.mktemp(f"int{bits}-{kind}") / "out"
    save_pretrained(model, directory)
    return kind, bits, directory, out, codes


def test_the_directory_holds_the_codes_and_the_record_marks_them(saved):
    kind, bits, directory, _, codes = saved
    record = json.loads((directory / "nmcompile.json").read_text())
    assert record[f"int{bits}"] == {"file": FILES[bits]} and f"int{12 - bits}" not in record
    assert {name for name, w in record["weights"].items() if w.get("bits") == bits} == set(codes) == set(record["weights"])
    assert not (directory / FILES[12 - bits]).exists()
    file = SafetensorsFile(directory / FILES[bits])
    name = next(iter(codes))
    out_f, in_f = record["weights"][name]["shape"][::-1] if kind == "gpt2" else record["weights"][name]["shape"]
    codes_spec, scales_spec = ((torch.int8, (out_f, in_f // 2)), (torch.float32, (out_f,))) if bits == 8 else \
        ((torch.uint8, (out_f, in_f // 4)), (torch.float16, (out_f, in_f // 64)))
    assert (file.dtype(f"{name}.codes"), file.shape(f"{name}.codes")) == codes_spec
    assert (file.dtype(f"{name}.meta"), file.shape(f"{name}.meta")) == (torch.int16, (out_f, in_f // 16))
    assert (file.dtype(f"{name}.scales"), file.shape(f"{name}.scales")) == scales_spec
    dense_bytes = sum(torch.Size(w["shape"]).numel() * 4 for w in record["weights"].values())  # fp32 model
    payload = sum(end - begin for _, _, begin, end in file.entries.values())
    # bits for half the positions, 2 bits of position per group of 4; 4 bytes of scale a row (int8), or 2 bytes
    # a row and group of 64 (4-bit): 5 bits a weight plus the rows' scales, or 3.25 bits a weight
    shapes = [torch.Size(w["shape"][::-1] if kind == "gpt2" else w["shape"]) for w in record["weights"].values()]
    assert payload == sum(s[0] * s[1] * 5 // 8 + s[0] * 4 if bits == 8 else s[0] * s[1] * 13 // 32 for s in shapes)
    assert payload < (0.2 if bits == 8 else 0.11) * dense_bytes
    assert check_path(directory, None, None, None).ok


def test_a_packed_load_reads_the_codes_and_runs_as_the_quantized_model_did(saved, monkeypatch):
    _, bits, directory, out, codes = saved
    read = []
    monkeypatch.setattr(loading, "read_packed", lambda source, key, *a: read.append(key) or _fail())
    model = load_pretrained(directory, packed=True, measure=False)
    assert not read  # every 2:4 weight came from the codes file; the dense copies were not read
    params = dict(model.named_parameters())
    for name, held in codes.items():
        p = params[name]
        assert p.quantized and p.int4 == (bits == 4) and _same(p, held)
        key = records.INT8 if bits == 8 else records.INT4
        assert torch.equal(records.get(model.get_submodule(name.rsplit(".", 1)[0]), key, "weight"), _grid(p))
    head = model.get_output_embeddings().weight
    assert head.quantized and head.dense_rows and head.int4 == (bits == 4)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, out, rtol=1e-5, atol=1e-5)
    kept = load_pretrained(directory, packed=True, measure=False, head=None)
    assert not getattr(kept.get_output_embeddings().weight, "quantized", False)


def test_a_plain_load_is_the_dequantized_model_and_packs_on_the_same_grid(saved):
    kind, bits, directory, out, codes = saved
    plain = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    with torch.no_grad():  # float weights: the kernel's sums in another order, and a float head (4-bit: and float
        # activations, where the kernel quantized them to int8)
        got = plain(IDS).logits
        torch.testing.assert_close(got, out, rtol=1e-3, atol=1e-3) if bits == 8 else \
            torch.testing.assert_close(got, out, rtol=0, atol=0.05 * float(out.abs().max()))
    model = load_pretrained(directory, measure=False)
    decisions = pack_weights(model, measure=False)  # bits left out: the recorded grids say which
    params = dict(model.named_parameters())
    for name, held in codes.items():
        assert f"{WIDTHS[bits]} grid" in decisions[name].reason
        assert _same(params[name], held)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, out, rtol=1e-5, atol=1e-5)


def test_a_fresh_process_loads_the_directory_packed(saved):
    kind, _, directory, out, _ = saved
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
    _, bits, directory, _, codes = saved
    copy = tmp_path / "copy"
    copy.mkdir()
    for entry in os.listdir(directory):
        (copy / entry).write_bytes((directory / entry).read_bytes())
    file = SafetensorsFile(copy / FILES[bits])
    name = next(iter(codes))
    tensors = {key: file.read(key) for key in file.keys()}
    tensors[f"{name}.scales"] = tensors[f"{name}.scales"] * 1.5  # another save's grid, say
    write_safetensors(copy / FILES[bits], [(k, t.dtype, t.shape, lambda t=t: t) for k, t in tensors.items()])
    report = check_path(copy, None, None, None)
    assert not report.ok and f"not the {WIDTHS[bits]} codes" in report[name].problem
    assert all(report[other].ok for other in codes if other != name)
    os.remove(copy / FILES[bits])
    with pytest.raises(ValueError, match=rf"hold {WIDTHS[bits]} values in {FILES[bits]}, which is missing"):
        load_pretrained(copy, packed=True, measure=False)
    assert "which is missing" in check_path(copy, None, None, None)[name].problem


@pytest.mark.parametrize("bits", [8, 4])
def test_a_weight_moved_off_its_grid_is_refused_by_name(tmp_path, bits):
    model, _, codes = _model("llama", bits)
    unpack_weights(model)
    name = next(iter(codes))
    with torch.no_grad():
        dict(model.named_parameters())[name].mul_(1.37)  # trained on after it was quantized, say
    with pytest.raises(ValueError, match=rf"kept values of {name} are not on the {WIDTHS[bits]} grid recorded for it"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def _fail():
    raise AssertionError("a 2:4 weight with int8 or 4-bit values was read from the dense files")


def test_a_head_named_where_it_cannot_apply_is_refused_not_ignored(saved, tmp_path):
    kind, bits, directory, _, _ = saved
    head = "lm_head"
    with pytest.raises(ValueError, match=rf"head='lm_head'.*loaded dense and its weights hold {WIDTHS[bits]} values"):
        load_pretrained(directory, head=head)  # dense: the head stays as stored
    float_model = tiny_llama(transformers)
    magnitude_2_4(float_model)
    save_pretrained(float_model, tmp_path / "float")
    with pytest.raises(ValueError, match=r"loaded packed and its weights hold float values.*pack_weights"):
        load_pretrained(tmp_path / "float", packed=True, head=head)
    load_pretrained(tmp_path / "float", packed=True, measure=False)  # the default ("auto") applies where it can


@pytest.mark.parametrize("bits", [8, 4])
def test_a_bf16_model_saves_and_loads_its_exact_codes(tmp_path, bits):
    """bf16 rounds code times scale by up to 0.496 steps (int8 codes near 127): still nearest to its own code, so
    the dense bf16 weights give the codes back exactly."""
    if bits == 4 and "avx2" not in cpu24.isas():
        pytest.skip("4-bit values run on the AVX2 kernel")
    torch.manual_seed(0)
    model = tiny_llama(transformers).to(torch.bfloat16).eval()
    magnitude_2_4(model)
    pack_weights(model, bits=bits, measure=False, head=None)
    held = {n: (p.values.clone(), p.bits.clone(), p.scales.clone(), p.dense()) for n, p in model.named_parameters()
            if getattr(p, "quantized", False)}
    unpack_weights(model)
    save_pretrained(model, tmp_path / "bf16")
    loaded = load_pretrained(tmp_path / "bf16", packed=True, measure=False, head=None)
    got = {n: p for n, p in loaded.named_parameters() if getattr(p, "quantized", False)}
    assert set(got) == set(held)
    for name, weight in held.items():
        assert _same(got[name], weight), name
    assert check_path(tmp_path / "bf16", None, None, None).ok
