"""benchmarks/training/recipe_steps.py (every recipe's GPT-2-small step against dense on a GPU): its code path runs
here on a tiny decoder on the CPU, so that a GPU's minutes are not spent on a Python error. No timing
is asserted; the times must only exist and be finite."""

import json
import math
import subprocess
import sys

import pytest
import torch

@pytest.fixture(scope="module")
def recipe_steps(benchmark_script):
    return benchmark_script("recipe_steps")


def test_nine_recipes_and_their_targets(recipe_steps):
    nine = {"ste", "sr_ste", "s_ste", "asp", "mdgf", "sdgf", "transposable", "bi_mask", "step"}
    assert nine <= set(recipe_steps.RECIPES) and nine <= set(recipe_steps.TARGETS)
    assert {r for r, t in recipe_steps.TARGETS.items() if t == 1.25} >= {"transposable", "bi_mask", "step"}


def test_summary_ratios_are_recipe_over_dense_and_the_mean_counts_refresh_steps(recipe_steps):
    samples = {"dense": [10.0, 10.0, 10.0, 10.0], "ste": [10.5, 10.5, 10.5, 10.5],
               "transposable": [11.0, 11.0, 11.0, 30.0], "asp": "RuntimeError: boom"}
    rows = recipe_steps.summarize(samples, ["dense", "ste", "transposable", "asp"])
    assert rows["ste"]["x_dense_median"] == pytest.approx(1.05) and rows["ste"]["within_target"]
    t = rows["transposable"]
    assert t["x_dense_median"] == pytest.approx(1.1) and t["x_dense_mean"] == pytest.approx(1.575)
    assert t["within_target"] is False  # the refresh steps count: a median alone would call it met
    assert rows["asp"] == {"error": "RuntimeError: boom"}
    assert "NOT MET" in recipe_steps.table(rows, {})


def test_own_work_is_what_exceeds_dense(recipe_steps):
    got = recipe_steps.own_work({"gemm": 5.0, "mask": 2.0, "adam": 1.0}, {"gemm": 5.5, "adam": 0.5})
    assert [row[0] for row in got["top"]] == ["mask", "adam"]
    assert got["excess_ms_per_step"] == pytest.approx(2.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_without_cuda_it_says_so_and_exits_0(recipe_steps, tmp_path, capsys):
    out = tmp_path / "steps.json"
    assert recipe_steps.main(["--out", str(out)]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().out
    assert "nothing measured" in json.loads(out.read_text())["skipped"]


@pytest.mark.slow
def test_tiny_cpu_run_times_every_recipe_and_profiles_one(tmp_path, recipe_steps):
    out = tmp_path / "steps.json"
    cmd = [sys.executable, recipe_steps.__file__, "--device", "cpu", "--tiny", "--inner", "aot_eager",
           "--reps", "2", "--warmup", "0", "--profile", "ste", "--profile-steps", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    variants = result["variants"]
    assert set(variants) == {"dense", *result["specs"]} and len(variants) == 11
    for name, row in variants.items():
        assert "error" not in row, (name, row)
        assert math.isfinite(row["median_ms"]) and math.isfinite(row["mean_ms"]) and row["steps"] == 2
        if name != "dense":
            assert math.isfinite(row["x_dense_median"])
            # forward, dgrad and wgrad of the 4 linears of the one block, all dense on the CPU under auto
            assert result["compiled"][name]["kernels"] == {"dense": 12}
    assert result["profiles"]["ste"]["top"], result["profiles"]
    assert "nmsparse" in " ".join(r[0] for r in result["profiles"]["ste"]["top"])
