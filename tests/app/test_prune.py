"""``nmcompile prune`` on a local Hugging Face model directory and on a torch.save'd model (no network)."""

from __future__ import annotations

import pytest
import torch

import nmcompile
from nmcompile.app.cli import main

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds that "
        "lour'd upon our house in the deep bosom of the ocean buried. ") * 12


def tiny_gpt2_dir(tmp_path):
    """A tiny GPT-2 with a byte-level tokenizer, written as a local Hugging Face directory."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    vocab["<unk>"] = len(vocab)
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    config = transformers.GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    path = tmp_path / "gpt2"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (tmp_path / "calib.txt").write_text(TEXT)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["sparsegpt:2:4", "wanda:2:4"])
def test_prune_a_local_hugging_face_model(tmp_path, capsys, recipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    path = tiny_gpt2_dir(tmp_path)
    out = tmp_path / "pruned"
    code = main(["prune", str(path), "--recipe", recipe, "--calibration", str(tmp_path / "calib.txt"), "--out",
                 str(out), "--seq-len", "32", "--samples", "16", "--quiet"])
    text = capsys.readouterr()
    assert code == 0, text.err
    assert "8 weights pruned" in text.out and "held-out loss" in text.out
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

    if cpu24.status().available:
        held = nmcompile.deploy.load_pretrained(out, packed=True)
        with torch.no_grad():
            assert abs(float(held(windows, labels=windows).loss) - after) < 1e-3


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
