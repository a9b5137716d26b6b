"""``nmcompile prune`` on a local Hugging Face model directory and on a torch.save'd model (no network)."""

from __future__ import annotations

import json
import os
from contextlib import nullcontext

import pytest
import torch

import nmcompile
from nmcompile.app.cli import main
from nmcompile.checkpoint import saving
from models import tiny_moe

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds that "
        "lour'd upon our house in the deep bosom of the ocean buried. ") * 12


def char_tokenizer():
    """A character-level tokenizer of the printable ASCII characters (96 ids with ``<unk>``), made offline."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    vocab["<unk>"] = len(vocab)
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")


def tiny_gpt2_dir(tmp_path, width=32):
    """A tiny GPT-2 with a byte-level tokenizer, written as a local Hugging Face directory."""
    transformers = pytest.importorskip("transformers")
    tokenizer = char_tokenizer()
    vocab = tokenizer.get_vocab()
    config = transformers.GPT2Config(vocab_size=len(vocab), n_embd=width, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    path = tmp_path / "gpt2"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (tmp_path / "calib.txt").write_text(TEXT)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["sparsegpt:2:4", "wanda:2:4,bits=8", "sparsegpt:2:4,bits=4"])
def test_prune_a_local_hugging_face_model(tmp_path, capsys, recipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    bits = 8 if recipe.endswith("bits=8") else 4 if recipe.endswith("bits=4") else None
    if bits == 4 and "avx2" not in nmcompile.kernels.cpu24.isas():
        pytest.skip("4-bit values run on the AVX2 kernel")
    path = tiny_gpt2_dir(tmp_path, 64 if bits == 4 else 32)  # 4-bit: widths a multiple of the group (64)
    out = tmp_path / "pruned"
    code = main(["prune", str(path), "--recipe", recipe, "--calibration", str(tmp_path / "calib.txt"), "--out",
                 str(out), "--seq-len", "32", "--samples", "16", "--quiet"])
    text = capsys.readouterr()
    assert code == 0, text.err
    assert "8 weights pruned" in text.out and "held-out loss" in text.out
    assert f"nmcompile check {out}" in text.out and f"load_pretrained({str(out)!r}, packed=True)" in text.out
    # every file listed with its size and whether a server needs it, this run's record too
    listed = {line.split()[1]: line for line in text.out.splitlines() if line.startswith("  wrote ")}
    assert set(listed) == {str(p) for p in out.iterdir()}, (listed, list(out.iterdir()))
    assert "ship for CPU serving" in listed[str(out / "model_packed.pt")] and " MB " in listed[str(out / "config.json")]
    assert "not needed to serve" in listed[str(out / "nmcompile-prune.json")]
    assert listed[str(out / "model.safetensors")].split("MB  ")[1].startswith("ship for dense loads, GPUs")
    cpu_mb, ratio, dense_mb = text.out.split("to serve on a CPU (load_pretrained(packed=True)): ")[1].split()[0:5:2]
    shipped = ("config.json", "nmcompile.json", "model_packed.pt", "generation_config.json")
    assert float(cpu_mb) == pytest.approx(sum(os.path.getsize(out / n) for n in shipped if (out / n).exists()) / 2**20,
                                          abs=0.06)
    assert float(ratio.rstrip("x,")) < 1  # the packed file is smaller than the dense one
    before, after = (float(v) for v in text.out.split("held-out loss")[1].split("dense ")[1].split(" (ppl")[0:1] +
                     text.out.split("-> pruned ")[1].split(" (ppl")[0:1])
    assert before > 0 and after > 0
    # a loadable Hugging Face directory (safetensors), 2:4 along each Conv1D's input (dim 0)
    assert (out / "model.safetensors").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    weights = {n: p for n, p in loaded.named_parameters() if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))}
    assert len(weights) == 8
    for name, w in weights.items():
        assert nmcompile.masks.count_violations(w.detach(), 2, 4, 0)[0] == 0, name
        assert float((w == 0).float().mean()) >= 0.5
    assert loaded.transformer.wte.weight.count_nonzero() == loaded.transformer.wte.weight.numel()  # tied head: dense
    # the printed loss is the loaded model's loss on the held-out tail
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    held = ids[int(0.9 * len(ids)):]
    windows = torch.stack([held[i * 32:(i + 1) * 32] for i in range(len(held) // 32)])
    with torch.no_grad():
        loss = loaded(windows, labels=windows).loss
    assert abs(float(loss) - after) < 1e-3
    # the directory records its layout: it loads as deployed, checks clean, and its packed file is packed
    assert (out / "nmcompile.json").exists() and (out / "model_packed.pt").exists()
    assert (out / "model_packed.pt").stat().st_size < (out / "model.safetensors").stat().st_size
    deployed = nmcompile.deploy.load_pretrained(out)
    assert nmcompile.check(deployed).ok and len(nmcompile.check(deployed)) == 8
    assert main(["check", str(out)]) == 0 and "8/8 tensors comply" in capsys.readouterr().out
    packed = torch.load(out / "model_packed.pt", weights_only=True)
    assert sum(k.endswith(".nm24_meta") for k in packed) == 8
    restored = nmcompile.deploy.unpack_state_dict(packed)
    assert all(torch.equal(restored[n], w) for n, w in weights.items())
    from nmcompile.kernels import cpu24

    assert (out / "model_int8.safetensors").exists() == (bits == 8)
    assert (out / "model_int4.safetensors").exists() == (bits == 4)
    if bits:  # the codes beside the dequantized weights: shipped, recorded, checked
        codes = "int8 codes" if bits == 8 else "4-bit codes"
        assert listed[str(out / f"model_int{bits}.safetensors")].split("MB  ")[1].startswith(
            f"ship for CPU serving: the 2:4 weights' {codes}")
        assert all(w["bits"] == bits for w in json.loads((out / "nmcompile.json").read_text())["weights"].values())
    if cpu24.status().available:
        held = nmcompile.deploy.load_pretrained(out, packed=True)
        assert all(getattr(held.get_parameter(n), "quantized", False) == bool(bits) for n in weights)
        assert all(getattr(held.get_parameter(n), "int4", False) == (bits == 4) for n in weights)
        with torch.no_grad():  # int8: the int8 kernel, and the tied head and embedding as int8 rows; 4-bit: 4-bit
            # rows, and int8 activations
            assert abs(float(held(windows, labels=windows).loss) - after) < {None: 1e-3, 8: 2e-2, 4: 5e-2}[bits]


@pytest.mark.slow
def test_prune_a_saved_character_model_sequentially(tmp_path, capsys):
    from nmcompile.app.chargpt import CharGPT, GPTConfig

    chars = sorted(set(TEXT))
    model = CharGPT(GPTConfig(vocab=len(chars), width=32, layers=2, heads=2, context=32))
    model.chars = chars
    torch.save(model, tmp_path / "char.pt")
    (tmp_path / "calib.txt").write_text(TEXT)
    out = tmp_path / "pruned"
    code = main(["prune", str(tmp_path / "char.pt"), "--recipe", "sparsegpt:2:4", "--calibration",
                 str(tmp_path / "calib.txt"), "--out", str(out), "--seq-len", "32", "--samples", "8", "--sequential",
                 "--exclude", "head*", "--quiet"])
    text = capsys.readouterr()
    assert code == 0, text.err
    pruned = torch.load(out / "model.pt", weights_only=False)
    assert nmcompile.check(pruned).ok and len(nmcompile.check(pruned)) > 0


def tiny_moe_dir(tmp_path, kind: str):
    """A tiny mixture of experts (tests/models.py:tiny_moe) with the character tokenizer, as a local directory."""
    transformers = pytest.importorskip("transformers")
    tokenizer = char_tokenizer()
    model = tiny_moe(transformers, kind, vocab=len(tokenizer.get_vocab()))
    path = tmp_path / kind
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (tmp_path / "calib.txt").write_text(TEXT)
    return path


#: per layer, the N:M tensors of the pruned directory's files: Mixtral's 4 attention projections and its fused
#: experts, which transformers writes as 4 x (w1, w2, w3); the per-expert model's mixing Linear and 4 x (w1, w2, w3)
MOE_FILE_TENSORS = {"mixtral": 4 + 12, "per_expert": 1 + 12}


@pytest.mark.slow
@pytest.mark.parametrize("sequential", [False, True], ids=["one-pass", "sequential"])
@pytest.mark.parametrize("kind", ["mixtral", "per_expert"])
def test_a_pruned_mixture_of_experts_checks_and_loads_packed(tmp_path, capsys, monkeypatch, kind, sequential):
    """Issue 52, row 1: transformers 5 holds a Mixtral's experts fused and writes them one Linear weight per
    expert, so the record named weights no file held (check: exit 2; the packed load: "parameters that no
    weights file holds"). Both layouts of experts now check clean and load, packed and dense, to the pruned
    model's logits."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_moe_dir(tmp_path, kind)
    kept, save = [], saving.save_pretrained
    monkeypatch.setattr(saving, "save_pretrained", lambda model, *a, **k: kept.append(model) or save(model, *a, **k))
    out = tmp_path / "pruned"
    code = main(["prune", str(path), "--recipe", "sparsegpt:2:4", "--calibration", str(tmp_path / "calib.txt"),
                 "--out", str(out), "--seq-len", "32", "--samples", "8", "--quiet",
                 *(["--sequential"] if sequential else [])])
    text = capsys.readouterr()
    assert code == 0, text.err
    assert ("sequential" in text.out) == sequential
    pruned = kept[0]
    report = nmcompile.check(pruned)
    assert report.ok and sum("experts" in name for name in report) == (4 if kind == "mixtral" else 24)

    assert main(["check", str(out)]) == 0
    checked = capsys.readouterr().out
    files = 2 * MOE_FILE_TENSORS[kind]
    assert f"{files}/{files} tensors comply" in checked
    block = "block_sparse_moe." if kind == "mixtral" else ""  # as the files name them
    for layer in range(2):
        for e in range(4):
            for w in ("w1", "w2", "w3"):
                assert f"layers.{layer}.{block}experts.{e}.{w}.weight: 2:4 along dim 1: ok" in checked
        assert f"layers.{layer}.{block}gate.weight: not checked (dense in the layout record" in checked  # the router

    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        expected = pruned(ids).logits
    with pytest.warns(UserWarning) if kind == "mixtral" else nullcontext() as caught:
        packed = nmcompile.deploy.load_pretrained(out, packed=True, measure=False)
    held = {n for n, p in packed.named_parameters() if isinstance(p, nmcompile.deploy.PackedLinearWeight)}
    if kind == "mixtral":  # the fused [experts, out, in] weights: loaded dense, and said so
        message = " ".join(str(w.message) for w in caught)
        for layer in range(2):
            for w in ("gate_up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{w} (a 3-D weight" in message
        assert len(held) == 8 and not any("experts" in n for n in held)
    else:
        assert len(held) == 26 and sum("experts" in n for n in held) == 24
    assert nmcompile.check(packed).ok and set(nmcompile.check(packed)) == set(report)
    dense = nmcompile.deploy.load_pretrained(out)
    assert nmcompile.check(dense).ok and set(nmcompile.check(dense)) == set(report)
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dense(ids).logits, expected)


def test_prune_refuses_bad_input_with_one_line(tmp_path, capsys):
    (tmp_path / "calib.txt").write_text("short")
    code = main(["prune", str(tmp_path / "missing"), "--calibration", str(tmp_path / "calib.txt"), "--out",
                 str(tmp_path / "o")])
    assert code == 2 and "no such model directory or file" in capsys.readouterr().err
    torch.save(torch.nn.Linear(4, 4), tmp_path / "m.pt")
    code = main(["prune", str(tmp_path / "m.pt"), "--recipe", "asp:2:4", "--calibration", str(tmp_path / "calib.txt"),
                 "--out", str(tmp_path / "o")])
    assert code == 2 and "takes a one-shot recipe (wanda, sparsegpt), not asp" in capsys.readouterr().err
    code = main(["prune", str(tmp_path / "m.pt"), "--calibration", str(tmp_path / "calib.txt"), "--out", str(tmp_path / "o")])
    assert code == 2 and "this model has no tokenizer" in capsys.readouterr().err


def prune(tmp_path, path, out, *extra):
    return main(["prune", str(path), "--recipe", "wanda:2:4", "--calibration", str(tmp_path / "calib.txt"), "--out",
                 str(out), "--seq-len", "32", "--samples", "4", "--quiet", *extra])


@pytest.mark.slow
def test_prune_never_writes_over_its_input_or_a_foreign_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_gpt2_dir(tmp_path)
    before = (path / "model.safetensors").read_bytes()
    assert prune(tmp_path, path, path) == 2
    assert "is (or holds, or is inside) the input model" in capsys.readouterr().err
    assert (path / "model.safetensors").read_bytes() == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "pytorch_model.bin").write_text("another model")
    assert prune(tmp_path, path, foreign) == 2
    assert "non-empty folder that nmcompile prune did not write" in capsys.readouterr().err
    assert (foreign / "pytorch_model.bin").read_text() == "another model"
    # --overwrite replaces the model in it: no weights file of the other model stays beside the new one,
    # and the user's other files do
    (foreign / "README-mine.md").write_text("notes")
    assert prune(tmp_path, path, foreign, "--overwrite") == 0, capsys.readouterr().err
    assert not (foreign / "pytorch_model.bin").exists() and (foreign / "model.safetensors").exists()
    assert (foreign / "README-mine.md").read_text() == "notes"
    # an earlier prune's folder is replaced without --overwrite, and a file the user put there is kept
    (foreign / "my-notes.txt").write_text("mine")
    (foreign / "mine").mkdir()
    (foreign / "mine" / "eval.json").write_text("{}")
    assert prune(tmp_path, path, foreign) == 0, capsys.readouterr().err
    assert (foreign / "my-notes.txt").read_text() == "mine" and (foreign / "mine" / "eval.json").read_text() == "{}"
    assert (foreign / "README-mine.md").read_text() == "notes"
    assert nmcompile.check(str(foreign)).ok
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("where, message", [
    ("", "the output folder is an empty path"),
    ("file/out", "which is a file"),
    ("file", "is a file; give a folder"),
    ("/proc/nmcompile-out", "cannot write the output beside /proc/nmcompile-out"),
    ("dangling", "which is not a folder"),
])
def test_prune_checks_out_before_any_work(tmp_path, capsys, monkeypatch, where, message):
    from nmcompile.app import prune as prune_module

    (tmp_path / "calib.txt").write_text(TEXT)
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr(prune_module, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    out = where if where.startswith("/") or not where else str(tmp_path / where)
    assert prune(tmp_path, tmp_path / "model", out) == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "x"


def test_prune_refuses_a_folder_it_cannot_write_before_loading(tmp_path, capsys, monkeypatch):
    import errno
    import os

    from nmcompile.app import prune as prune_module
    from nmcompile.checkpoint import folders

    (tmp_path / "calib.txt").write_text(TEXT)
    monkeypatch.setattr(prune_module, "_load", lambda *a, **k: pytest.fail("the model was loaded"))

    def read_only(dir, prefix):  # as a read-only folder answers, also to root
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(folders.tempfile, "mkdtemp", read_only)
    assert prune(tmp_path, tmp_path / "model", tmp_path / "ro" / "out") == 2
    err = capsys.readouterr().err
    assert "cannot write the output beside" in err and "Read-only file system" in err


@pytest.mark.slow
def test_prune_writes_through_a_link_and_cleans_what_a_killed_run_left(tmp_path, capsys, monkeypatch):
    import os

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_gpt2_dir(tmp_path)
    disk = tmp_path / "other-disk"
    (disk / "models").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(disk / "models")
    dead = 2 ** 22 + 12345  # above the default pid_max: no such process
    left = disk / f".models.partial-{dead}-abc"
    left.mkdir()
    (left / "model.safetensors").write_text("half written")
    with pytest.warns(UserWarning, match="left beside .* by an interrupted run"):
        assert prune(tmp_path, path, link) == 0, capsys.readouterr().err
    assert link.is_symlink() and os.readlink(link) == str(disk / "models")  # the link stays a link
    assert (disk / "models" / "model.safetensors").exists() and nmcompile.check(str(link)).ok
    assert not left.exists()
    assert sorted(p.name for p in disk.iterdir()) == ["models"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_prune_whose_output_would_not_fit_on_disk_stops_before_calibrating(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from nmcompile.app import prune as prune_module
    from nmcompile.checkpoint import saving

    path = tiny_gpt2_dir(tmp_path)
    monkeypatch.setattr(saving, "_free_bytes", lambda directory: 1000)
    monkeypatch.setattr(prune_module, "_loss", lambda *a, **k: pytest.fail("calibration work began"))
    assert prune(tmp_path, path, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "nmcompile prune: saving the model to" in err and "and that disk has 0.0 GB free" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_interrupted_prune_leaves_no_folder_that_looks_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from nmcompile.checkpoint import saving

    path = tiny_gpt2_dir(tmp_path)
    out = tmp_path / "out"
    assert prune(tmp_path, path, out) == 0
    written = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def interrupted(model, folder, **kwargs):
        model.save_pretrained(folder, safe_serialization=True)  # the weights, then the interrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(saving, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prune(tmp_path, path, out, "--recipe", "sparsegpt:2:4")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == written  # the earlier output, whole
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


@pytest.mark.slow
def test_prune_keeps_a_bf16_model_in_bf16(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    path = tiny_gpt2_dir(tmp_path)
    transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    assert prune(tmp_path, path, tmp_path / "out") == 0
    assert "(bfloat16)" in capsys.readouterr().out
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert prune(tmp_path, path, tmp_path / "out32", "--dtype", "float32") == 0
    with safe_open(str(tmp_path / "out32" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "128"], "--seq-len 128 is longer than the model's 64 positions"),
    (["--seq-len", "0"], "--seq-len 0: must be at least 2"),
    (["--batch", "0"], "--batch 0: must be at least 1"),
    (["--samples", "0"], "--samples 0: must be at least 1"),
])
def test_prune_names_bad_numbers(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_gpt2_dir(tmp_path)
    assert prune(tmp_path, path, tmp_path / "out", *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_prune_names_bad_calibration_files(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_gpt2_dir(tmp_path)
    torch.save(torch.arange(1000) % 500, tmp_path / "ids.pt")
    code = main(["prune", str(path), "--calibration", str(tmp_path / "ids.pt"), "--out", str(tmp_path / "o"),
                 "--seq-len", "32", "--quiet"])
    assert code == 2 and "token ids from 0 to 499, but the model's vocabulary has 96" in capsys.readouterr().err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 400)
    code = main(["prune", str(path), "--calibration", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "o"),
                 "--seq-len", "32", "--quiet"])
    assert code == 2 and "not UTF-8 text" in capsys.readouterr().err
    (path / "tokenizer.json").unlink()
    code = main(["prune", str(path), "--calibration", str(tmp_path / "calib.txt"), "--out", str(tmp_path / "o"),
                 "--seq-len", "32", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "no tokenizer could be loaded" in err and "--tokenizer DIR" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("form, bars", [
    ("one-pass", ["one-pass calibration, batches", "solving, weights"]),
    ("sequential", ["sequential one-shot, blocks"]),
])
def test_prune_shows_each_phase(tmp_path, capsys, monkeypatch, form, bars):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_gpt2_dir(tmp_path)
    extra = ["--sequential"] if form == "sequential" else []
    code = main(["prune", str(path), "--recipe", "wanda:2:4", "--calibration", str(tmp_path / "calib.txt"), "--out",
                 str(tmp_path / "out"), "--seq-len", "32", "--samples", "4", *extra])
    err = capsys.readouterr().err
    assert code == 0, err
    phases = ["nmcompile prune: loading", "held-out loss, dense", *bars, "held-out loss, pruned", "nmcompile prune: saving to"]
    where = [err.find(phase) for phase in phases]
    assert -1 not in where and where == sorted(where), (phases, err)
    assert "eta" in err


def test_each_file_of_a_pruned_folder_says_whether_a_server_needs_it():
    from nmcompile.app.prune import file_role

    assert file_role("model_packed.pt").startswith("ship for CPU serving")
    assert file_role("nmcompile-prune.json").endswith("not needed to serve")
    for name in ("nmcompile.json", "model.safetensors", "model-00001-of-00002.safetensors", "config.json",
                 "tokenizer.json", "model.pt", "model.safetensors.index.json"):
        assert file_role(name).startswith("ship"), name
