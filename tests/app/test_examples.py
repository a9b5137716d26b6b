import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_digits_example(tmp_path):
    pytest.importorskip("sklearn")
    out = tmp_path / "w.pt"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--steps", "60", "--inner", "aot_eager",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "+ 0.weight: s_ste:2:4" in result.stdout
    assert "N:M check: 2/2 tensors comply" in result.stdout
    assert "nmcompile.finalize: 2 weights are N:M" in result.stdout
    # the deploy report on a CPU machine: the 2:4 CPU kernel where it measured faster, else dense and why
    assert re.search(r"0\.weight: (cpu24 \(\w+\): |dense: (the 2:4 CPU kernel .* measured|.*2:4 CPU kernel))", result.stdout)
    assert "onnxruntime vs PyTorch: max |diff|" in result.stdout and (tmp_path / "w.onnx").exists()
    assert "of dense fp16" in result.stdout
    import torch
    import nmcompile

    state = torch.load(out)
    assert nmcompile.check({k: state[k] for k in ("0.weight", "2.weight")}).ok
    accuracy = float(result.stdout.split("s_ste:2:4: final train loss")[1].split("test accuracy ")[1].split()[0])
    assert accuracy > 0.8  # 10 classes: chance is 0.1
