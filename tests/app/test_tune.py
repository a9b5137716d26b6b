"""``nmcompile tune DIR``: each distinct linear shape of a model's config timed once, into the decision
cache, which a later compile then reads without timing. The timer is faked (deterministic)."""

import subprocess
import sys

import pytest
import torch

from nmcompile.app.cli import main
from nmcompile.app import tune as tune_module
from nmcompile.app.tune import tune
from nmcompile.kernels import cpu24
from nmcompile.kernels.dispatch import cpu as cpu_dispatch
from nmcompile.kernels.dispatch import cache as decision_cache

REAL_MACHINE_BUSY = tune_module.machine_busy
needs_kernel = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")


@pytest.fixture
def llama_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256)
    config.save_pretrained(tmp_path / "tiny-llama")
    return tmp_path / "tiny-llama"


@pytest.fixture
def fake_timer(monkeypatch):
    """A layer 2x faster sparse up to 4 tokens, slower above; counts the shapes timed. The machine reads as
    quiet (the suite's other worker keeps the load average up; these timings are fake)."""
    timed = []
    monkeypatch.setattr(tune_module, "machine_busy", lambda: None)

    def layer_timer(out_f, in_f, dtype, bias, isa, packed_only):
        timed.append((out_f, in_f, dtype, packed_only))
        return lambda tokens: ([2.0] * 9, [1.0] * 9) if tokens <= 4 else ([1.0] * 9, [2.0] * 9)

    monkeypatch.setattr(cpu_dispatch, "layer_timer", layer_timer)
    cpu_dispatch._ratios.cache_clear()
    yield timed
    cpu_dispatch._ratios.cache_clear()


@needs_kernel
def test_tune_times_each_distinct_shape_once_and_a_compile_then_reads_it(llama_dir, fake_timer, capsys, monkeypatch):
    code = main(["tune", str(llama_dir), "--threads", "1", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    shapes = {(64, 64), (32, 64), (128, 64), (64, 128)}  # q/o, k/v, gate/up, down; lm_head [256, 64] left out
    assert {(o, i) for o, i, _, _ in fake_timer} == shapes and len(fake_timer) == 2 * len(shapes)  # two routes
    assert {packed for *_, packed in fake_timer} == {False, True}
    for o, i in shapes:
        assert f"[{o}, {i}]" in out
    assert "[256, 64]" not in out and "left out (1): lm_head: kept dense by default: an output head" in out
    assert "1 to 4" in out and "at 1 token: 2.00x, at 2 tokens: 2.00x, at 4 tokens: 2.00x, at 8 tokens: 0.50x" in out and out.count("stored") == 8
    assert len(list((decision_cache.cache_root() / "cpu24").glob("*.json"))) == 8
    assert f"measured on: {decision_cache.describe_cpu(decision_cache.cpu_identity())}" in out

    def refuse(*args):
        raise AssertionError("timed although tune stored this shape")

    monkeypatch.setattr(cpu_dispatch, "layer_timer", refuse)
    cpu_dispatch._ratios.cache_clear()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the thread count tune timed at
    try:
        max_tokens, ladder = cpu_dispatch.sparse_ladder(128, 64, torch.float32, False, cpu24.best_isa(torch.float32))
    finally:
        torch.set_num_threads(before)
    assert max_tokens == 4 and ladder.source == "cached"


@needs_kernel
def test_tune_takes_dtypes_routes_and_static_token_counts(llama_dir, fake_timer, capsys):
    code = main(["tune", str(llama_dir), "--dtype", "bf16", "--route", "compile", "--tokens", "3", "--quiet", "--all"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert {dtype for _, _, dtype, _ in fake_timer} == {torch.bfloat16}
    assert {packed for *_, packed in fake_timer} == {False}
    assert "[256, 64]" in out  # --all: the head too
    assert len(fake_timer) == 5 * 2  # five shapes, each the dynamic ladder and 3 tokens
    assert "3 to 3" in out


def test_tune_errors_say_what_was_wrong(tmp_path, capsys, monkeypatch):
    assert main(["tune", str(tmp_path / "missing")]) == 2
    assert "has no config.json; pass a Hugging Face model directory" in capsys.readouterr().err
    monkeypatch.setenv("NMCOMPILE_DECISION_CACHE", "off")
    assert main(["tune", str(tmp_path)]) == 2
    assert "the decision cache is off (NMCOMPILE_DECISION_CACHE=off)" in capsys.readouterr().err


def test_the_command_s_help_does_not_load_tune_or_transformers():
    code = ("import sys\nfrom nmcompile.app import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('nmcompile.app.tune' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "False False", done.stdout + done.stderr
    assert "tune" in done.stdout


@pytest.mark.parametrize("option, value", [("--tokens", "0"), ("--tokens", "-4"), ("--tokens", "two"),
                                           ("--threads", "0"), ("--threads", "-1")])
def test_a_count_that_is_not_positive_is_refused_before_any_work(option, value, llama_dir, capsys, monkeypatch):
    def refuse(*args):
        raise AssertionError("timed although an option was refused")

    monkeypatch.setattr(cpu_dispatch, "layer_timer", refuse)
    with pytest.raises(SystemExit) as exit_:
        main(["tune", str(llama_dir), option, "1", value, "--quiet"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"argument {option}: {value!r} is not a positive integer" in err and "1 or more" in err, err


@pytest.mark.parametrize("field", ["tokens", "threads"])
def test_tune_refuses_counts_that_are_not_positive(field, llama_dir, monkeypatch):
    monkeypatch.setattr(cpu_dispatch, "layer_timer", lambda *args: pytest.fail("timed"))
    with pytest.raises(ValueError, match=f"{field}: 0 is not a positive integer"):
        tune(llama_dir, **{field: [2, 0]})


@needs_kernel
def test_tune_says_what_it_could_not_store(llama_dir, fake_timer, capsys, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NMCOMPILE_CACHE_DIR", str(blocker))  # a file where the folder should be: nothing can be written
    with pytest.warns(UserWarning, match="cannot write the decision cache"):
        code = main(["tune", str(llama_dir), "--threads", "1", "--route", "compile", "--quiet"])
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("[")]
    assert len(rows) == 4 and all("not stored: cannot write" in line for line in rows), captured.out
    assert " stored" not in captured.out.replace("not stored", "")  # no row claims what did not happen
    assert f"decision cache: {blocker / 'cpu24'}: 0 of 4 decisions written" in captured.out
    assert code == 1 and "4 decisions could not be written" in captured.err


@needs_kernel
def test_the_estimate_sums_each_shape_s_kernels_in_every_format(llama_dir, monkeypatch):
    """Each shape timed once per format and counted once per layer of that shape; the head as each format holds it;
    the bytes are the formats' own (a fake clock: every call of a variant costs its code)."""
    from nmcompile.app import tune as tune_module

    calls = []
    cost = {"dense": 4.0, "2:4": 2.0, "2:4+int8": 1.0, "torch int8": 3.0, "int8 rows": 1.5, "2:4+int8 a8": 0.5,
            "int8 rows a8": 0.75}

    def time_shape(out_f, in_f, dtype, head, rounds):
        calls.append((out_f, in_f, head))
        weights = tune_module._weights(out_f, in_f, dtype, head)
        return {name: (cost[name] * 1e-3, tune_module._bytes(t)) for name, t in weights.items()}

    monkeypatch.setattr(tune_module, "_time_shape", time_shape)
    costs = {c.format: c for c in tune_module.token_costs(llama_dir, dtype=torch.bfloat16)}
    assert sorted(calls) == sorted([(64, 64, False), (32, 64, False), (128, 64, False), (64, 128, False),
                                    (256, 64, True)])
    layers = 2 * (2 + 2 + 2 + 1)  # q, o, k, v, gate, up, down per block
    assert costs["dense"].linear_seconds == pytest.approx((layers + 1) * 4e-3)
    assert costs["2:4"].linear_seconds == pytest.approx(layers * 2e-3 + 4e-3)  # the head dense
    assert costs["2:4+int8"].linear_seconds == pytest.approx(layers * 1e-3 + 1.5e-3)  # the head int8 rows
    assert costs["torch int8"].linear_seconds == pytest.approx((layers + 1) * 3e-3)
    if "avx2" in cpu24.isas():  # int8 activations: the same bytes on their own kernels
        assert costs["2:4+int8 a8"].linear_seconds == pytest.approx(layers * 0.5e-3 + 0.75e-3)
        assert costs["2:4+int8 a8"].weight_bytes == costs["2:4+int8"].weight_bytes
    linear = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3)
    assert costs["dense"].weight_bytes == 2 * (linear + 256 * 64)  # bf16
    assert costs["2:4+int8"].weight_bytes < costs["torch int8"].weight_bytes < costs["2:4"].weight_bytes \
        < costs["dense"].weight_bytes
    # the other bytes (norms, an embedding row, the KV cache of 160 positions) at the dense kernels' bandwidth
    other = 2 * (64 * (2 * 2 + 1) + 64) + 2 * 2 * 2 * 16 * 160 * 2
    bandwidth = costs["dense"].weight_bytes / costs["dense"].linear_seconds
    assert all(c.other_seconds == pytest.approx(other / bandwidth) for c in costs.values())


@needs_kernel
def test_the_command_prints_the_estimate_unless_told_not_to(llama_dir, fake_timer, capsys):
    assert main(["tune", str(llama_dir), "--threads", "1", "--quiet", "--route", "compile"]) == 0
    out = capsys.readouterr().out
    assert "what a decoded token would cost, estimated from this machine's kernels at 1 thread(s)" in out
    for fmt in ("dense", "2:4", "2:4+int8", "torch int8"):
        assert any(line.split()[:1] == [fmt.split()[0]] for line in out.splitlines())
    assert main(["tune", str(llama_dir), "--quiet", "--route", "compile", "--no-estimate"]) == 0
    assert "what a decoded token would cost" not in capsys.readouterr().out


@needs_kernel
def test_a_busy_machine_is_named_and_nothing_is_stored_unless_asked(llama_dir, fake_timer, capsys, monkeypatch):
    monkeypatch.setattr(tune_module.os, "getloadavg", lambda: (9.5, 9.0, 8.0))
    monkeypatch.setattr(tune_module, "machine_busy", REAL_MACHINE_BUSY)  # the fixture's quiet machine, undone
    with pytest.warns(RuntimeWarning, match=r"machine is busy \(load average 9.5 over the last minute"):
        code = main(["tune", str(llama_dir), "--threads", "1", "--route", "compile", "--quiet", "--no-estimate"])
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("[")]
    assert len(rows) == 4 and all("not stored: the machine is busy" in line for line in rows), captured.out
    assert "0 of 4 decisions written; 4 not stored: the machine was busy" in captured.out
    assert code == 1 and "none of 4 decisions was stored" in captured.err
    assert not list((decision_cache.cache_root() / "cpu24").glob("**/*.json"))  # nothing kept
    assert main(["tune", str(llama_dir), "--threads", "1", "--route", "compile", "--quiet", "--no-estimate",
                 "--even-if-busy"]) == 0
    assert "4 of 4 decisions written" in capsys.readouterr().out
