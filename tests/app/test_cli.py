import json
import pickle
import subprocess
import sys

import pytest
import torch

import nmcompile
from nmcompile.app.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "nmcompile.app.cli", *args], capture_output=True, text=True, timeout=300)


def run_here(capsys, *args):
    """``(exit status, stdout, stderr)`` of the command run in this process (an exception fails the test)."""
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_check_reports_compliance_and_sets_exit_code(tmp_path):
    w = torch.randn(8, 16)
    good = tmp_path / "good.pt"
    bad = tmp_path / "bad.pt"
    torch.save({"fc.weight": nmcompile.masks.prune(w, 2, 4, 1), "fc.bias": torch.zeros(8)}, good)
    torch.save({"state_dict": {"fc.weight": w}}, bad)
    ok = run("check", str(good))
    assert ok.returncode == 0 and "1/1 tensors comply" in ok.stdout
    fail = run("check", str(bad), "--pattern", "2:4")
    assert fail.returncode == 1 and "32/32 groups violate" in fail.stdout


def test_recipes_lists_each_recipes_own_keys_as_the_parser_spells_them(capsys):
    import re

    code, out, _ = run_here(capsys, "recipes")
    assert code == 0
    lines = {line.split(":N:M")[0]: line for line in out.splitlines() if ":N:M  " in line}
    assert sorted(lines) == sorted(nmcompile.recipes.RECIPES)
    assert lines["sr_ste"] == "sr_ste:N:M  wgrad=dense (or mvue12, mvue24), decay=0.0002"
    assert "wgrad" not in lines["wanda"] and "wgrad" not in lines["sparsegpt"]  # one shot: nothing trains
    assert "update=on" in lines["sparsegpt"] and "permute=on" in lines["asp"] and "fp8=off" in lines["s_ste"]
    assert "total_steps (required)" in lines["step"] and "t_min=0.1" in lines["step"]
    for name, line in lines.items():  # every key=default shown is a recipe string the parser takes back
        keys = line.split(":N:M  ")[1].split("  [")[0]
        required = ",total_steps=10" if "total_steps (required)" in keys else ""
        for key, value in re.findall(r"(\w+)=([^,\s]+)", keys):
            recipe = nmcompile.recipe(f"{name}:2:4,{key}={value}{required}")
            assert getattr(recipe, key) == getattr(type(recipe)(**({"total_steps": 10} if required else {})), key)


class _NotAStateDict:
    pass


def unreadable_files(tmp_path):
    sd = {"fc.weight": nmcompile.masks.prune(torch.randn(8, 16), 2, 4, 1)}
    files = {}
    files["empty.pt"] = b""
    torch.save(sd, tmp_path / "full.pt")
    whole = (tmp_path / "full.pt").read_bytes()
    files["truncated.pt"] = whole[: len(whole) // 2]
    torch.save({"fc.weight": nmcompile.masks.prune(torch.randn(64, 128), 2, 4, 1)}, tmp_path / "large.pt")
    large = (tmp_path / "large.pt").read_bytes()
    files["truncated-large.pt"] = large[: len(large) // 2]  # cut after the first 4 kB: OSError [Errno 22] in the zip reader
    files["garbage.pt"] = b"hello, this is not a checkpoint"
    files["plain-pickle.pt"] = pickle.dumps({"fc.weight": [1.0, 2.0]}, protocol=4)
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    torch.save(torch.nn.Linear(16, 8), tmp_path / "whole-model.pt")  # needs weights_only=False
    torch.save({"fc.weight": sd["fc.weight"], "extra": _NotAStateDict()}, tmp_path / "object.pt")
    names = [*files, "whole-model.pt", "object.pt", "missing.pt", "no-tensors.pt", "biases-only.pt"]
    torch.save({"epoch": 3, "note": "no weights"}, tmp_path / "no-tensors.pt")
    torch.save({"fc.bias": torch.zeros(8)}, tmp_path / "biases-only.pt")  # nothing 2-D to check
    return names


@pytest.mark.slow  # subprocesses
def test_check_gives_unreadable_input_its_own_exit_code_and_one_line(tmp_path, capsys):
    for name in unreadable_files(tmp_path):
        code, _, err = run_here(capsys, "check", str(tmp_path / name))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (name, code, err)
        assert lines[0].startswith("nmcompile check: ") and name in lines[0], (name, err)
    out = run("check", str(tmp_path / "whole-model.pt"))  # the installed command: no traceback either
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "save model.state_dict()" in out.stderr, out.stderr


def test_check_of_unreadable_onnx_files_exits_2(tmp_path, capsys):
    pytest.importorskip("onnx")
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "corrupt.onnx").write_bytes(b"\x08\x07garbage\xff\xff\xff" * 20)
    for name in ("empty.onnx", "corrupt.onnx"):
        code, out, err = run_here(capsys, "check", str(tmp_path / name))
        assert code == 2 and err.startswith(f"nmcompile check: {tmp_path / name}: not ") and err.count("\n") == 1, err


def test_check_finds_the_state_dict_in_a_checkpoint(tmp_path, capsys):
    w = torch.randn(8, 16)
    torch.save({"model": {"fc.weight": w}, "epoch": 3}, tmp_path / "bad.pt")
    torch.save({"model": {"fc.weight": nmcompile.masks.prune(w, 2, 4, 1)}, "epoch": 3,
                "optimizer": {"state": {0: {"exp_avg": w}}}}, tmp_path / "good.pt")
    code, out, _ = run_here(capsys, "check", str(tmp_path / "bad.pt"))
    assert code == 1 and "32/32 groups violate" in out and "['model']" in out
    code, out, _ = run_here(capsys, "check", str(tmp_path / "good.pt"))
    assert code == 0 and "1/1 tensors comply" in out


def test_report_of_malformed_run_json_exits_2_with_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bad = {
        "not-json": "{loss: [",
        "a-list": "[1, 2]",
        "no-loss": json.dumps({"eval": [], "recipe": "sr_ste:2:4"}),
        "loss-not-pairs": json.dumps({"loss": [1, 2, 3], "eval": [], "recipe": "x"}),
        "loss-not-list": json.dumps({"loss": 3, "recipe": "x"}),
        "diagnostics-lengths": json.dumps({"loss": [[1, 0.5]], "recipe": "x", "diagnostics": {
            "fc.weight": {"flip_rate": [0.1, 0.2], "flip_rate_steps": [1]}}}),
        "diagnostics-text": json.dumps({"loss": [[1, 0.5]], "recipe": "x", "diagnostics": {
            "fc.weight": {"sad": ["a"], "sad_steps": [1]}}}),
        "switch-list": json.dumps({"loss": [[1, 0.5]], "recipe": "x", "diagnostics": {
            "fc.weight": {"switch_step": [3]}}}),
        "sparsity-text": json.dumps({"loss": [[1, 0.5]], "recipe": "x", "sparsity": {"fc.weight": "half"}}),
    }
    for name, text in bad.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(text)
        code, _, err = run_here(capsys, "report", str(tmp_path / name))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and str(tmp_path / name / "run.json") in lines[0], (name, err)
    good = tmp_path / "good"
    good.mkdir()
    (good / "run.json").write_text(json.dumps({"loss": [[1, 0.5], [2, 0.4]], "diagnostics": {
        "fc.weight": {"flip_rate": [0.1], "flip_rate_steps": [1], "switch_step": -1}}, "sparsity": {"fc.weight": 0.5}}))
    code, _, err = run_here(capsys, "report", str(good))
    assert code == 0 and (good / "loss.png").exists() and (good / "masks.png").exists(), err


class TinyLM(torch.nn.Module):
    """An embedding, declared blocks and a head kept dense (here by exclude=["lm_head"])."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        self.lm_head = torch.nn.Linear(32, 64)

    def forward(self, ids):
        return self.lm_head(self.blocks(self.embed(ids)))


def test_check_of_a_state_dict_can_check_the_declared_weights_only(tmp_path, capsys):
    torch.manual_seed(0)
    model = TinyLM()
    nmcompile.annotate(model, "sr_ste:2:4", exclude=["lm_head"])
    nmcompile.finalize(model)
    assert nmcompile.check(model).ok
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    code, out, err = run_here(capsys, "check", str(path))  # the embedding and the head are dense
    assert code == 1 and "embed.weight" in out
    assert "2 of 4 tensors are 2:4 along dim 1" in err and f"nmcompile check {path} --only 'blocks.*'" in err
    code, out, err = run_here(capsys, "check", str(path), "--only", "blocks.*.weight")
    assert code == 0 and "2/2 tensors comply" in out and "2 other tensors not checked" in out and not err
    code, _, err = run_here(capsys, "check", str(path), "--only", "blocks.0.*", "--only", "blocks.2.*")
    assert code == 0
    code, _, err = run_here(capsys, "check", str(path), "--only", "decoder.*")
    assert code == 2 and "no tensor in it matched --only decoder.*" in err
    report = nmcompile.check(path, only=["blocks.*"])
    assert report.ok and set(report) == {"blocks.0.weight", "blocks.2.weight"}


def test_a_packed_file_that_lost_a_metadata_entry_is_damaged(tmp_path, capsys):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    nmcompile.annotate(model, "sr_ste:2:4")
    nmcompile.finalize(model)
    packed = nmcompile.deploy.pack_state_dict(model.state_dict())
    torch.save(packed, tmp_path / "packed.pt")
    code, out, _ = run_here(capsys, "check", str(tmp_path / "packed.pt"))
    assert code == 0 and "2/2 tensors comply" in out
    del packed["2.weight.nm24_meta"]
    torch.save(packed, tmp_path / "damaged.pt")
    code, out, err = run_here(capsys, "check", str(tmp_path / "damaged.pt"))
    assert code == 2 and not out and "damaged" in err and "2.weight was written packed but its metadata" in err
    loaded = torch.load(tmp_path / "damaged.pt", weights_only=True)
    with pytest.raises(ValueError, match="2.weight was written packed but its metadata 2.weight.nm24_meta is missing"):
        nmcompile.deploy.unpack_state_dict(loaded)
    loaded = torch.load(tmp_path / "packed.pt", weights_only=True)
    del loaded["2.weight"]  # the metadata without its values
    with pytest.raises(ValueError, match="damaged: 2.weight.nm24_meta has no values entry '2.weight'"):
        nmcompile.deploy.unpack_state_dict(loaded)
    # an intact file still loads into the plain model, with PyTorch's own metadata kept
    restored = nmcompile.deploy.unpack_state_dict(torch.load(tmp_path / "packed.pt", weights_only=True))
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    fresh.load_state_dict(restored)
    assert torch.equal(fresh[2].weight, model[2].weight)
    assert "nmcompile.nm24" not in restored._metadata and restored._metadata[""] == model.state_dict()._metadata[""]


def test_check_of_a_pruned_directory_uses_its_layout_record(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from models import _gpt2, magnitude_2_4

    model = _gpt2(transformers)
    magnitude_2_4(model)
    nmcompile.deploy.save_pretrained(model, tmp_path / "pruned")
    capsys.readouterr()  # Hugging Face's progress bar
    for path in (tmp_path / "pruned", tmp_path / "pruned" / "model.safetensors"):
        code, out, err = run_here(capsys, "check", str(path))
        assert code == 0 and "8/8 tensors comply" in out and "along dim 0: ok" in out and not err
        assert "transformer.wte.weight: not checked (dense in the layout record" in out
    (tmp_path / "pruned" / "nmcompile.json").rename(tmp_path / "record.json")
    from safetensors.torch import load_file, save_file

    plain = tmp_path / "plain.safetensors"  # the same weights, no record anywhere
    save_file(load_file(tmp_path / "pruned" / "model.safetensors"), plain)
    code, out, err = run_here(capsys, "check", str(plain))
    assert code == 1 and "0/10 tensors comply" in out
    hint = err.strip().rsplit("Check those with: ", 1)[1]
    assert hint == f"nmcompile check {plain} --dim 0 --only 'transformer.h.*'"
    code, out, err = run_here(capsys, "check", str(plain), "--dim", "0", "--only", "transformer.h.*")
    assert code == 0 and "8/8 tensors comply" in out
