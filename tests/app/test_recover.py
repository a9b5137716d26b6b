"""``nmcompile recover``: a pruned Hugging Face directory distilled from its dense teacher with its mask kept,
written whole (check passes, a packed load serves it), resumed where an interrupted run stopped, and bad input
refused by name."""

from __future__ import annotations

import json

import pytest
import torch

import nmcompile
from nmcompile.app import recover as recover_module
from nmcompile.app.cli import main
from nmcompile.training.distill import Distillation

from test_prune import TEXT, char_tokenizer

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """``(dense dir, pruned dir, text file)``: a tiny Llama trained a little on the text, then SparseGPT 2:4."""
    tmp = tmp_path_factory.mktemp("recover")
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tokenizer.get_vocab()), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, bos_token_id=0, eos_token_id=0, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    dense = tmp / "llama"
    tokenizer.save_pretrained(dense)
    (tmp / "calib.txt").write_text(TEXT)
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):  # well better than chance, so that pruning costs something
        starts = torch.randint(len(ids) - 33, (8,), generator=gen)
        batch = torch.stack([ids[s:s + 32] for s in starts])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(dense)
    out = tmp / "pruned"
    assert main(["prune", str(dense), "--recipe", "sparsegpt:2:4", "--calibration", str(tmp / "calib.txt"), "--out",
                 str(out), "--seq-len", "32", "--samples", "8", "--quiet"]) == 0
    return dense, out, tmp / "calib.txt"


def _args(pruned, out, steps=30, *extra):
    dense, directory, text = pruned
    return ["recover", str(directory), "--teacher", str(dense), "--data", str(text), "--out", str(out), "--steps",
            str(steps), "--seq-len", "32", "--batch", "4", "--lr", "1e-3", "--inner", "aot_eager", "--quiet",
            *extra]


def _weights(directory):
    model = nmcompile.deploy.load_pretrained(directory)
    return {n: p.detach() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2}


def test_recover_closes_the_gap_keeps_the_mask_and_writes_a_servable_directory(pruned, tmp_path, capsys):
    out = tmp_path / "recovered"
    assert main(_args(pruned, out)) == 0
    text = capsys.readouterr().out
    assert "nmcompile recover: 14 N:M weights trained 30 steps with asp:2:4,permute=0 on cpu" in text
    teacher, before, after = (float(text.split(name)[1].split()[0].rstrip(",")) for name in
                              ("teacher ", "pruned ", "-> recovered "))
    assert teacher < before and after < before - 0.3 * (before - teacher)  # the gap closes
    record = json.loads((out / "nmcompile-recover.json").read_text())
    assert record["loss_after"] == pytest.approx(after, abs=1e-4) and record["steps"] == 30
    was, now = _weights(pruned[1]), _weights(out)
    assert set(was) == set(now) and len(now) == 14
    for name, w in now.items():  # the one-shot's mask, exactly: no zero lost, none added
        assert torch.equal(w == 0, was[name] == 0), name
        assert not torch.equal(w, was[name]), name  # and trained
    assert main(["check", str(out)]) == 0
    if nmcompile.kernels.cpu24.status().available:
        served = nmcompile.deploy.load_pretrained(out, packed=True)
        assert type(served.model.layers[0].mlp.up_proj.weight).__name__ == "PackedLinearWeight"
    assert not (tmp_path / "recovered.recover-state.pt").exists()


def test_an_interrupted_recovery_resumes_where_it_stopped(pruned, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    assert main(_args(pruned, whole, 20, "--save-every", "10")) == 0
    calls = []
    real = Distillation.__call__

    def dies(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 15:
            raise KeyboardInterrupt  # a kill after the state of step 10 was written
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Distillation, "__call__", dies)
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        recover_module.recover_model(*[str(p) for p in (pruned[1], pruned[0], pruned[2], cut)], steps=20, lr=1e-3,
                                     seq_len=32, batch_size=4, save_every=10, inner="aot_eager", progress=False)
    assert not cut.exists() and (tmp_path / "cut.recover-state.pt").exists()
    monkeypatch.setattr(Distillation, "__call__", real)
    summary = recover_module.recover_model(*[str(p) for p in (pruned[1], pruned[0], pruned[2], cut)], steps=20,
                                           lr=1e-3, seq_len=32, batch_size=4, save_every=10, inner="aot_eager",
                                           progress=False)
    assert summary.resumed_at == 10 and not (tmp_path / "cut.recover-state.pt").exists()
    a, b = _weights(whole), _weights(cut)
    assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in a)  # the same run as the uninterrupted one


def test_bad_input_is_refused_by_name(pruned, tmp_path, capsys):
    dense, directory, text = pruned
    assert main(_args(pruned, directory)) == 2  # --out is the input
    assert "is (or holds, or is inside) the input model" in capsys.readouterr().err
    assert main(_args(pruned, tmp_path / "o2", 5, "--seq-len", "1")) == 2
    assert "--seq-len 1: must be at least 2" in capsys.readouterr().err


@pytest.fixture(scope="module")
def pruned4(pruned, tmp_path_factory):
    """``(dense dir, 2:4+4-bit pruned dir, text file)``: the same tiny Llama, SparseGPT 2:4 with 4-bit values."""
    dense, _, text = pruned
    out = tmp_path_factory.mktemp("recover4") / "pruned4"
    assert main(["prune", str(dense), "--recipe", "sparsegpt:2:4,bits=4", "--calibration", str(text), "--out",
                 str(out), "--seq-len", "32", "--samples", "8", "--quiet"]) == 0
    return dense, out, text


def test_a_4bit_model_recovers_as_a_4bit_model(pruned4, tmp_path, capsys):
    """Weights held as 4-bit codes train on their grids (asp:2:4,permute=0,bits=4, straight-through) and come back
    as 4-bit codes: every recovered weight lies on its 4-bit grid with the one-shot's mask, and a packed load
    serves the codes the forward trained on."""
    from nmcompile.kernels.cpu24.quantize import round_groups4

    out = tmp_path / "recovered4"
    assert main(_args(pruned4, out)) == 0
    text = capsys.readouterr().out
    assert "14 N:M weights trained 30 steps with asp:2:4,permute=0,bits=4 on cpu" in text
    teacher, before, after = (float(text.split(name)[1].split()[0].rstrip(",")) for name in
                              ("teacher ", "pruned ", "-> recovered "))
    # (here the one-shot 4-bit model happens to be as good as the teacher on the held-out windows: the distilled
    # one is better than both)
    assert after < min(before, teacher) - 0.01, (teacher, before, after)
    record = json.loads((out / "nmcompile.json").read_text())
    assert (out / "model_int4.safetensors").exists() and all(w["bits"] == 4 for w in record["weights"].values())
    was, now = _weights(pruned4[1]), _weights(out)
    assert len(now) == 14
    for name, w in now.items():
        assert torch.equal(round_groups4(w.float(), 64), w.float()), name  # on its 4-bit grid
        # no position outside the one-shot's mask, except in a group where a kept value was rounded to code 0 (the
        # dense file cannot say which zero was kept: the mask keeps another zero of the group, still 2:4)
        grown = ((w != 0) & (was[name] == 0)).view(w.shape[0], -1, 4).any(-1)
        short = ((was[name] != 0).view(w.shape[0], -1, 4).sum(-1) < 2)
        assert not bool((grown & ~short).any()), name
        assert not torch.equal(w, was[name]), name  # and trained
    assert main(["check", str(out)]) == 0
    if "avx2" in nmcompile.kernels.cpu24.isas():
        served = nmcompile.deploy.load_pretrained(out, packed=True)
        weight = served.model.layers[0].mlp.up_proj.weight
        assert type(weight).__name__ == "PackedLinearWeight" and weight.quantized
        assert torch.equal(weight.dense().float(), now["model.layers.0.mlp.up_proj.weight"].float())


def test_a_recipe_that_does_not_match_the_directorys_values_is_refused(pruned4, tmp_path, capsys):
    dense, directory, text = pruned4
    for recipe, says in (("asp:2:4,permute=0", "holds 4-bit values; --recipe asp:2:4,permute=0 would train and save "
                                               "them as float values: give --recipe asp:2:4,permute=0,bits=4"),
                         ("asp:2:4,permute=0,bits=8", "holds 4-bit values in groups of 64; --recipe "
                                                      "asp:2:4,permute=0,bits=8 rounds to bits=8")):
        assert main(_args(pruned4, tmp_path / "o", 5, "--recipe", recipe)) == 2
        assert says in capsys.readouterr().err
        assert not (tmp_path / "o").exists()


def test_a_bf16_student_trains_in_float32_where_the_cpu_has_no_bf16_arithmetic_and_it_fits(monkeypatch):
    from nmcompile.oneshot import compute_dtype

    student = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
    monkeypatch.setattr(recover_module.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(compute_dtype, "_cpu_flags", lambda: frozenset({"avx2"}))
    dtype, why = recover_module._training_dtype(student, None)
    assert dtype == torch.float32 and "no native bfloat16 arithmetic" in why and "saved in bfloat16" in why
    monkeypatch.setattr(recover_module.memory, "available_bytes", lambda: 4096)  # 4160 parameters * 20 bytes
    dtype, why = recover_module._training_dtype(student, None)
    assert dtype == torch.bfloat16 and "do not fit in the memory available" in why and "--dtype float32" in why
    assert recover_module._training_dtype(student, torch.float32) == (torch.float32, "as asked (--dtype)")
    monkeypatch.setattr(compute_dtype, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert recover_module._training_dtype(student, None)[0] == torch.bfloat16
    assert recover_module._training_dtype(student.float(), None) == (torch.float32, "the stored dtype")


def test_a_weight_recorded_as_codes_whose_grid_did_not_load_is_refused():
    from types import SimpleNamespace

    layout = SimpleNamespace(weights={"fc.weight": SimpleNamespace(bits=4, shape=(8, 64), dim=1)})
    with pytest.raises(ValueError, match="fc.weight is recorded with 4-bit values but its grid was not loaded"):
        recover_module._recipes("d", layout, {}, None)
    grid = {"fc.weight": (4, torch.ones(8, 1, dtype=torch.float16))}
    assert recover_module._recipes("d", layout, grid, None) == {"asp:2:4,permute=0,bits=4": ["fc.weight"]}
