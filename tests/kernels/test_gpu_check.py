"""benchmarks/gpu/gpu_check.py: on a machine without CUDA it says so, writes its JSON and table, and exits
0; its summaries and target verdicts are checked here on made-up rows (the real numbers come only
from a GPU run)."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import nmcompile

@pytest.fixture
def gpu_check(benchmark_script):
    return benchmark_script("gpu_check")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_without_cuda_it_says_so_writes_its_files_and_exits_0(tmp_path, gpu_check):
    done = subprocess.run([sys.executable, gpu_check.__file__, "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA GPU here" in done.stdout and "nothing measured" in done.stdout
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["env"]["cuda_available"] is False and result["env"]["torch"] == torch.__version__
    assert "nothing measured" in result["message"] and result["targets"] == []
    assert "nothing measured" in (tmp_path / "gpu_check.md").read_text()


def test_kernel_summary_reads_train_report_and_a_step_trains(gpu_check):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    nmcompile.annotate(model, gpu_check.TARGET)
    assert gpu_check.kernels_summary(model) == ("0.weight: not compiled yet; 2.weight: not compiled yet", [])
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager", "train_kernel": "reference"})
    x, dy = torch.randn(32, 32, requires_grad=True), torch.randn(32, 32)
    gpu_check.step_fn(model, compiled, (x, dy))()
    assert all(p.grad is not None for p in model.parameters())
    text, speedups = gpu_check.kernels_summary(model)
    assert text == "0.weight: reference/reference/reference; 2.weight: reference/reference/reference"
    assert speedups == []  # the reference kernel is never timed


def test_targets_and_table_from_rows(gpu_check):
    shape, T, G = "vit-l 12608x1024->4096->1024", gpu_check.TARGET, gpu_check.GRAPHS
    rows = [
        {"shape": shape, "variant": "dense", "ms": 2.0, "vs_dense": 1.0, "kernels": "", "sparse_speedups": []},
        {"shape": shape, "variant": f"{T} [cusparselt]", "ms": 1.6, "vs_dense": 1.25, "kernels": "",
         "sparse_speedups": []},
        {"shape": shape, "variant": f"{T} [auto]", "ms": 1.9, "vs_dense": 1.05, "kernels": "x",
         "sparse_speedups": [1.2, 0.9]},
        {"shape": shape, "variant": f"{T} [cusparselt{G}]", "ms": 1.0, "vs_dense": 1.4, "kernels": "",
         "sparse_speedups": []},
    ]
    gpt = [{"shape": "GPT-2-small step 8x1024", "variant": "dense", "ms": 30.0, "vs_dense": 1.0, "kernels": "",
            "sparse_speedups": []},
           {"shape": "GPT-2-small step 8x1024", "variant": f"{T} [auto]", "ms": 40.0, "vs_dense": 0.75, "kernels": "",
            "sparse_speedups": []}]
    deploy = {"status": 0, "linear": [{"shape": "llm 16x4096->11008", "dense": 1.0, "nmsparse": 1.0},
                                      {"shape": "vit-l fc1 13008x1024->4096", "dense": 3.0, "nmsparse": 1.5,
                                       "dense_graphs": 2.0, "nmsparse_graphs": 1.6}]}
    result = {"env": {"cuda_available": True}, "train_mlp": rows, "train_gpt2": gpt, "deploy": deploy,
              "tests": {"cmd": "pytest -m gpu", "status": 0, "seconds": 1.0, "tail": ["5 passed"]}}
    verdicts = {t["target"]: (t["measured"], t["status"]) for t in gpu_check.targets(result)}
    assert verdicts[f"MLP block fwd+bwd, vit-l, {T} [cusparselt] >= 1.3x dense compiled"] == (1.25, "not met")
    assert verdicts[f"MLP block fwd+bwd, vit-l, {T} [cusparselt{G}] >= 1.3x dense compiled"] == (1.4, "met")
    assert not any(t.startswith("MLP block fwd+bwd, gpt2") for t in verdicts)  # nothing measured, nothing claimed
    assert verdicts[f"GPT-2-small training step, {T} [auto] >= 1.1x"] == (0.75, "not met")
    assert verdicts["deploy large GEMM >= 1.5x (vit-l fc1 13008x1024->4096)"] == (2.0, "met")
    assert verdicts["deploy large GEMM >= 1.5x (vit-l fc1 13008x1024->4096, CUDA graphs both)"] == (1.25, "not met")
    assert verdicts["no layer slower than dense under auto"] == (0.9, "not met")
    rows[2]["sparse_speedups"] = []  # auto measured every 2:4 GEMM slower and kept it dense
    kept = {t["target"]: t["status"] for t in gpu_check.targets(result)}["no layer slower than dense under auto"]
    assert kept.startswith("met: auto kept every training GEMM dense")
    for r in (rows[2], gpt[1]):
        r["ms"] = "skipped: time budget"  # no auto row measured: nothing claimed
    assert {t["target"]: t["status"] for t in gpu_check.targets(result)}["no layer slower than dense under auto"] == "not measured"
    rows[2].update(ms=1.9, sparse_speedups=[1.2, 0.9])
    result["targets"] = gpu_check.targets(result)
    table = gpu_check.markdown(result)
    assert f"| {shape} | {T} [cusparselt] | 1.600 | 1.25 |" in table
    assert "| deploy large GEMM >= 1.5x (vit-l fc1 13008x1024->4096) | 2.0 | met |" in table
    assert "| vit-l fc1 13008x1024->4096 | 3.000 | 1.500 | 2.0 | 2.000 | 1.600 | 1.25 |" in table


# ---- the per-file test budget (the risks only a GPU settles: tests/kernels/test_gpu_risks.py)


def test_gpu_tests_run_per_file_within_their_budget(gpu_check, monkeypatch):
    files = gpu_check.gpu_test_files()
    assert "tests/kernels/test_training_kernels.py" in files and "tests/deploy/test_deploy.py" in files
    assert "tests/training/test_training_modes.py" in files and "tests/kernels/test_gpu_check.py" not in files
    calls = []

    def fake_run(cmd, timeout):
        calls.append((cmd[-1], timeout))
        status = "timeout" if cmd[-1].endswith("test_training_modes.py") else 0
        return {"cmd": cmd[-1], "status": status, "seconds": 1.0, "tail": ["1 passed"]}

    monkeypatch.setattr(gpu_check, "run", fake_run)
    monkeypatch.setattr(gpu_check, "has_xdist", lambda: True)  # one run over every file, 8 processes
    whole = gpu_check.gpu_tests(gpu_check.Clock(10_000), budget=100.0)
    assert len(calls) == 1 and calls[0][1] == 100.0 and whole["cmd"] == "pytest -m gpu -n 8 (every file)"
    calls.clear()
    monkeypatch.setattr(gpu_check, "has_xdist", lambda: False)  # one run per file
    result = gpu_check.gpu_tests(gpu_check.Clock(10_000), budget=len(files) * 30.0)
    assert [path for path, _ in calls] == files  # a timeout in one file leaves the others to run
    timeouts = [t for _, t in calls]  # a fair share first; what a file leaves unused passes on to the next
    assert 29 <= timeouts[0] <= 30 and timeouts == sorted(timeouts) and timeouts[-1] <= len(files) * 30.0, calls
    assert result["status"] == "not passed: tests/training/test_training_modes.py"
    assert len(result["files"]) == len(files)
    calls.clear()
    short = gpu_check.gpu_tests(gpu_check.Clock(10_000), budget=5.0)
    assert calls == [] and {p["status"] for p in short["files"]} == {"skipped: time budget"}
