"""The CPU deploy path: the 2:4 CPU kernel chosen per layer by timing, its token range, its fallbacks.

Timings never decide a test: the range logic is checked with given ratios, and the compiled graph's
routing with forced and patched decisions. The measured numbers live in benchmarks/cpu/cpu_deploy.py.
"""

import itertools

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile.backends.nmsparse import nmsparse_backend
from nmcompile.kernels import cpu24
from nmcompile.kernels.dispatch import cpu as cpu_dispatch
from nmcompile.kernels.dispatch import Decision, qualify

needs_kernel = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")
CPU_OP = torch.ops.nmsparse.cpu24_linear.default if cpu24.status().available else None


def finalized(dtype=torch.float32, widths=(64, 128, 32)):
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())][:-1])
    nmcompile.annotate(model, "sr_ste:2:4")
    nmcompile.finalize(model)
    return model.to(dtype).eval()


def spy(model, **options):
    """``torch.compile`` through the nmsparse backend (inner="eager"), keeping the rewritten graphs."""
    graphs = []

    def backend(gm, example_inputs):
        runner = nmsparse_backend(gm, example_inputs, options={"inner": "eager", **options})
        graphs.append(runner.compiled.__self__)
        return runner

    return torch.compile(model, backend=backend, dynamic=options.pop("dynamic", None)), graphs


def cpu_calls(graphs):
    return [n for gm in graphs for n in gm.graph.nodes if n.target is CPU_OP]


def rewritten_calls(model, x, **options):
    compiled, graphs = spy(model, **options)
    with torch.no_grad():
        out = compiled(x)
    return out, cpu_calls(graphs)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forced_cpu24_rewrites_every_linear_and_keeps_the_function(dtype):
    model = finalized(dtype)
    x = torch.randn(5, 3, 64).to(dtype)
    out, calls = rewritten_calls(model, x, deploy_kernel="cpu24")
    assert len(calls) == 2 and all(c.args[6] == -1 and c.args[7] == cpu24.best_isa(dtype) for c in calls)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=tol, atol=tol)
    report = nmcompile.deploy_report(model)
    assert all(d.kernel == "cpu24" and d.token_range == "1 and up" for d in report.values()), report


@needs_kernel
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_autocast_casts_the_kernel_s_operands_as_f_linear_does(model_dtype):
    # without an autocast kernel: "input dtype Float differs from the weight's BFloat16" when compiled
    model = finalized(model_dtype)
    x = torch.randn(6, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, calls = rewritten_calls(model, x, deploy_kernel="cpu24")
        with torch.no_grad():
            expected = model(x)
    assert len(calls) == 2 and out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.inductor
@needs_kernel
def test_inductor_calls_the_kernel_as_an_extern_op():
    model = finalized()
    compiled = torch.compile(model, backend="nmsparse", options={"deploy_kernel": "cpu24"})
    x = torch.randn(4, 64)
    with torch.no_grad():
        compiled(x)
        with torch.profiler.profile() as prof:
            out = compiled(x)
    torch.testing.assert_close(out, model(x))
    assert sum(e.key == "nmsparse::cpu24_linear" for e in prof.key_averages()) == 1


def _patched_ratios(monkeypatch, ratios):
    def fake(out_f, in_f, dtype, bias, isa, threads, ladder, packed_only=False):
        kept = []
        for count in ladder:
            ratio = ratios.get(count, 0.5)
            kept.append((count, ratio, ratio > cpu_dispatch.MARGIN))
            if ratio <= cpu_dispatch.MARGIN:
                break
        return cpu_dispatch.Ladder(tuple(kept))

    monkeypatch.setattr(cpu_dispatch, "_ratios", fake)


@needs_kernel
def test_the_sparse_range_ends_below_the_first_rung_that_was_not_faster(monkeypatch):
    _patched_ratios(monkeypatch, {1: 2.4, 2: 2.2, 4: 1.9, 8: 1.01, 16: 1.5})
    w = nmcompile.masks.prune(torch.randn(32, 64), 2, 4, 1)
    decision = cpu_dispatch.measure_cpu(qualify(w, "auto"), w, None, None)
    assert decision.kernel == "cpu24" and decision.max_tokens == 4 and decision.speedup == 2.4
    assert [t for t, _ in decision.ratios] == [1, 2, 4, 8]  # the ladder stops at the first loss
    assert "sparse for 1 to 4 tokens, dense above" in str(decision)
    _patched_ratios(monkeypatch, {1: 0.9})
    slow = cpu_dispatch.measure_cpu(qualify(w, "auto"), w, None, None)
    assert slow.kernel == "dense" and "measured 0.90x of dense at 1 tokens" in slow.reason
    _patched_ratios(monkeypatch, {64: 1.3})
    static = cpu_dispatch.measure_cpu(qualify(w, "auto"), w, None, 64)
    assert static.kernel == "cpu24" and static.max_tokens == 64 and static.ratios == ((64, 1.3),)


@needs_kernel
def test_a_win_inside_the_timing_noise_is_not_taken(monkeypatch):
    """The median favours the kernel at 2 tokens (1.08x) but the quartiles overlap, spread wider than
    that ratio's distance from the margin: timed again, the same each time, so the bytes decide, and
    they promise nothing at 2 tokens: the range ends at 1."""
    one = ([2.0] * 5, [1.0] * 5)  # 1 token: clearly faster
    two = ([1.0, 1.0, 1.3, 1.3, 1.3], [0.9, 0.9, 1.2, 1.2, 1.2])  # 2 tokens: dense q1 1.0 vs sparse q3 1.2
    series = itertools.chain([one], itertools.repeat(two, 1 + cpu_dispatch.RETRIES),
                             [([9.0] * 5, [1.0] * 5)])  # never reached: the ladder stops at the unsettled rung
    monkeypatch.setattr(cpu_dispatch, "time_series", lambda first, second, budget=0: next(series))
    cpu_dispatch._ratios.cache_clear()
    try:
        max_tokens, ratios = cpu_dispatch.sparse_range(32, 64, torch.float32, False, "avx2", ladder=(1, 2, 4))
    finally:
        cpu_dispatch._ratios.cache_clear()
    assert max_tokens == 1
    assert [t for t, _ in ratios] == [1, 2] and ratios[0][1] == 2.0 and abs(ratios[1][1] - 1.3 / 1.2) < 1e-9
    assert next(series) == ([9.0] * 5, [1.0] * 5)  # rung 2 was timed 1 + RETRIES times, rung 4 never


@pytest.mark.parametrize("copies", [1, 3, 4, 8])
def test_timing_rotates_weight_copies_so_each_call_reads_a_cold_one(copies):
    turn = cpu_dispatch.rotation(copies)
    calls = [(kernel, turn(kernel)) for _ in range(3 * copies) for kernel in ("dense", "sparse")]
    for kernel in ("dense", "sparse"):
        seen = [i for k, i in calls if k == kernel]
        assert all(seen.count(i) == 3 for i in range(copies))  # every copy, in turn
        assert all(b == (a + 1) % copies for a, b in zip(seen, seen[1:]))
    if copies >= 3:
        assert all(a[1] != b[1] for a, b in zip(calls, calls[1:]))  # never the copy just read


@needs_kernel
def test_dispatch_timing_reads_enough_copies_to_leave_the_cache(monkeypatch):
    """A small layer is timed on several copies of its weight (together over COLD_BYTES, at most
    MAX_COPIES); the kernels' calls walk through them."""
    read = []
    real_linear = cpu_dispatch.F.linear

    class Spy:
        @staticmethod
        def linear(x, w, b=None):
            read.append(w.data_ptr())
            return real_linear(x, w, b)

    monkeypatch.setattr(cpu_dispatch, "F", Spy)
    cpu_dispatch._ratios.cache_clear()
    try:
        cpu_dispatch.sparse_range(64, 256, torch.float32, False, cpu24.best_isa(torch.float32), ladder=(1,))
    finally:
        cpu_dispatch._ratios.cache_clear()
    assert len(set(read)) == cpu_dispatch.MAX_COPIES  # a 64 KB weight: the cap, not one copy
    assert all(a != b for a, b in zip(read, read[1:]))


@needs_kernel
def test_dynamic_token_counts_above_the_range_take_dense_inside_the_op(monkeypatch):
    _patched_ratios(monkeypatch, {1: 3.0, 2: 3.0, 4: 2.0})
    model = finalized()
    compiled, graphs = spy(model, dynamic=True)
    with torch.no_grad():
        for tokens in (3, 4, 5, 40):
            x = torch.randn(tokens, 64)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    calls = cpu_calls(graphs)
    assert calls and all(c.args[6] == 4 for c in calls)
    assert all(d.token_range == "1 to 4" for d in nmcompile.deploy_report(model).values())


def test_qualify_rules_on_cpu(monkeypatch):
    w = nmcompile.masks.prune(torch.randn(32, 64), 2, 4, 1)
    assert "float64 has no 2:4 CPU kernel" in qualify(w.double(), "auto").reason
    odd = nmcompile.masks.prune(torch.randn(32, 40), 2, 4, 1)
    assert qualify(odd, "auto").kernel == "dense" and "in_features 40 is not a multiple of 16" in qualify(odd, "auto").reason
    with pytest.raises(ValueError, match="deploy_kernel='cpu24' cannot be used: in_features 40"):
        qualify(odd, "cpu24")
    broken = cpu24.Status(False, "building the 2:4 CPU kernel failed (RuntimeError): error: no such intrinsic")
    monkeypatch.setattr(cpu24, "status", lambda: broken)
    decision = qualify(w, "auto")
    assert decision.kernel == "dense" and decision.reason == broken.reason  # the compiler's message, named
    with pytest.raises(ValueError, match="deploy_kernel='cpu24' cannot be used: building the 2:4 CPU kernel failed"):
        qualify(w, "cpu24")


def test_a_cpu_without_the_kernel_deploys_dense_with_the_reason(monkeypatch):
    arm = cpu24.Status(False, "the 2:4 CPU kernel is x86-64 only (this CPU is aarch64)")
    monkeypatch.setattr(cpu24, "status", lambda: arm)
    model = finalized()
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="nmsparse")(x), model(x))
    assert all(d == Decision("dense", arm.reason) for d in nmcompile.deploy_report(model).values())


@pytest.mark.slow
def test_a_build_that_fails_is_reported_with_the_compilers_message(tmp_path):
    import os
    import shutil
    import subprocess
    import sys
    import textwrap

    fake = tmp_path / "c++"
    real = shutil.which("c++") or "c++"
    fake.write_text(  # answers version probes like the real compiler, fails every compilation
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "-c" ] && {{ echo "fatal error: this compiler was made to fail" >&2; exit 1; }}; done\n'
        f'exec {real} "$@"\n'
    )
    fake.chmod(0o755)
    script = textwrap.dedent("""
        import torch
        from torch import nn
        import nmcompile
        model = nn.Sequential(nn.Linear(64, 32))
        nmcompile.annotate(model, "ste:2:4")
        nmcompile.finalize(model)
        x = torch.randn(2, 64)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model.eval(), backend="nmsparse")(x), model(x))
        print(nmcompile.deploy_report(model)["0.weight"])
    """)
    env = {**os.environ, "CXX": str(fake), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dense: building the 2:4 CPU kernel failed" in done.stdout and "made to fail" in done.stdout, done.stdout


def _change_weight(model, route):
    """Give ``model[0].weight`` new 2:4 values through ``route``, none of which PyTorch counts as a version."""
    from nmcompile import masks

    weight = model[0].weight
    new = masks.prune(torch.randn_like(weight), 2, 4, 1)
    if route == "data.copy_":
        weight.data.copy_(new)
    elif route == "data =":
        weight.data = new
    else:
        vector = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
        vector[: new.numel()] = new.flatten()
        torch.nn.utils.vector_to_parameters(vector, model.parameters())


@needs_kernel
@pytest.mark.parametrize("route", ["data.copy_", "data =", "vector_to_parameters"])
def test_a_weight_changed_behind_the_version_counter_is_packed_again(route):
    model = finalized()
    compiled, graphs = spy(model, deploy_kernel="cpu24")
    x = torch.randn(3, 64)
    with torch.no_grad():
        compiled(x)
        _change_weight(model, route)
        torch.testing.assert_close(compiled(x), model(x))
    assert len(cpu_calls(graphs)) == 2  # still the kernel, on the new weight


@needs_kernel
def test_a_forced_kernel_that_cannot_take_a_layer_names_it_and_the_fix():
    model = finalized(widths=(20, 32, 20))  # 0: in_features 20; 2: [20, 32] fits
    with pytest.raises(Exception, match=r"0\.weight \(\[32, 20\]\): deploy_kernel='cpu24' cannot be used: in_features "
                                        r"20 .*deploy_kernel='auto'.*deploy_report, or pad"):
        rewritten_calls(model, torch.randn(3, 20), deploy_kernel="cpu24")
    torch._dynamo.reset()
    rewritten_calls(model, torch.randn(3, 20), deploy_kernel="auto")  # the fix it names compiles
    assert nmcompile.deploy_report(model)["0.weight"].kernel == "dense"


def test_the_weight_sample_read_at_each_call_is_small_and_spread():
    from nmcompile.backends.deploy_runner import SAMPLED_ROWS, _sample_index

    rows, cols = 4096, 1024
    index = _sample_index(torch.zeros(rows, cols))
    assert index.numel() == 2 * SAMPLED_ROWS  # read at every call of every layer: not two per row
    sampled_rows = sorted(set((index // cols).tolist()))
    assert len(sampled_rows) == SAMPLED_ROWS and sampled_rows[0] == 0 and sampled_rows[-1] == rows - 1
    assert len(set((index % cols).tolist())) == 2 * SAMPLED_ROWS  # columns spread too
    small = _sample_index(torch.zeros(5, 64))
    assert sorted(set((small // 64).tolist())) == [0, 1, 2, 3, 4]  # every row of a small weight
