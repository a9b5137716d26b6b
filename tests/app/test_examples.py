import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


def _in_git_checkout() -> bool:
    return shutil.which("git") is not None and _git("rev-parse", "--is-inside-work-tree").stdout.strip() == "true"


@pytest.mark.slow
def test_train_digits_example_leaves_the_clone_clean():
    pytest.importorskip("sklearn")
    if not _in_git_checkout():
        pytest.skip("not a git checkout")
    before = _git("status", "--porcelain").stdout
    out = ROOT / "runs" / "digits"
    existed = out.exists()
    try:
        result = subprocess.run(  # as a user runs it: from the clone's root, the default output folder
            [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--steps", "60", "--inner", "aot_eager"],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert _git("status", "--porcelain").stdout == before  # wrote nothing git sees
        assert sorted(p.name for p in out.iterdir()) == ["digits_nm.onnx", "digits_nm.packed.pt", "digits_nm.pt"]
        assert "+ 0.weight: s_ste:2:4" in result.stdout
        assert "N:M check: 2/2 tensors comply" in result.stdout
        assert "nmcompile.finalize: 2 weights are N:M" in result.stdout
        # the deploy report on a CPU machine: the 2:4 CPU kernel where it measured faster, else dense and why
        assert re.search(r"0\.weight: (cpu24 \(\w+\): |dense: (the 2:4 CPU kernel .* measured|.*2:4 CPU kernel))",
                         result.stdout)
        assert "onnxruntime vs PyTorch: max |diff|" in result.stdout
        assert "of dense fp16" in result.stdout
        # each model's compile reported apart from its training steps
        assert re.search(r"dense: final train loss .* \(first step with its compile [\d.]+ s, then 59 steps [\d.]+ s\)",
                         result.stdout)
        import torch
        import nmcompile

        state = torch.load(out / "digits_nm.pt")
        assert nmcompile.check({k: state[k] for k in ("0.weight", "2.weight")}).ok
        accuracy = float(result.stdout.split("s_ste:2:4: final train loss")[1].split("test accuracy ")[1].split()[0])
        assert accuracy > 0.8  # 10 classes: chance is 0.1
    finally:
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
            if not any((ROOT / "runs").iterdir()):
                (ROOT / "runs").rmdir()


def test_the_demo_and_the_examples_write_into_folders_git_ignores():
    if not _in_git_checkout():
        pytest.skip("not a git checkout")
    from nmcompile.app.demo import run_demo

    demo = inspect.signature(run_demo).parameters["out"].default
    example = re.search(r'default=os\.path\.join\(("[^)]*")\)', (ROOT / "examples" / "train_digits.py").read_text())
    example_dir = "/".join(part.strip().strip('"') for part in example.group(1).split(","))
    paths = [f"{demo}/run.json", f"{demo}/model.onnx", f"{demo}/loss.png", example_dir,
             example_dir.replace(".pt", ".onnx")]
    ignored = _git("check-ignore", "--no-index", *paths).stdout.split()
    assert ignored == paths
