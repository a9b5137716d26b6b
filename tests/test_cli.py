import subprocess
import sys

import torch

import nmcompile


def run(*args):
    return subprocess.run([sys.executable, "-m", "nmcompile.cli", *args], capture_output=True, text=True, timeout=300)


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


def test_recipes_lists_keys_and_defaults():
    out = run("recipes")
    assert out.returncode == 0
    assert "sr_ste:N:M  (wgrad=dense, decay=0.0002)" in out.stdout
