"""The CPU dispatch's decisions on disk: a second process decides without timing; the key holds what
decides; bad files, the switch and the folder rules.

Each test has its own empty cache folder (tests/conftest.py sets NMCOMPILE_CACHE_DIR).
"""

import json
import platform
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nmcompile.kernels import cpu24
from nmcompile.kernels.dispatch import cpu as cpu_dispatch
from nmcompile.kernels.dispatch import cache as decision_cache

needs_kernel = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")

RUNGS = ((1, 2.5, True), (2, 2.0, True), (4, 0.9, False))


def entry_key(**changes):
    fields = dict(out_features=256, in_features=512, dtype=torch.float32, bias=True, isa="avx2", threads=2,
                  ladder=(1, 2, 4), packed_only=False, method=cpu_dispatch.TIMING_METHOD)
    fields.update(changes)
    return decision_cache.key(**fields)


def cache_files():
    folder = decision_cache.cache_root() / "cpu24"
    return sorted(p.name for p in folder.glob("*.json")) if folder.exists() else []


@pytest.fixture
def no_timing(monkeypatch):
    """The timer fails the test if called; _ratios' in-process memo is cleared before and after."""
    def refuse(*args, **kwargs):
        raise AssertionError("timed although the decision cache holds this key")

    monkeypatch.setattr(cpu_dispatch, "layer_timer", refuse)
    cpu_dispatch._ratios.cache_clear()
    yield
    cpu_dispatch._ratios.cache_clear()


COMPILE = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import nmcompile
    from nmcompile.kernels.dispatch import cpu as cpu_dispatch
    if sys.argv[1] == "refuse":
        def refuse(*args, **kwargs):
            raise AssertionError("timed in the second process")
        cpu_dispatch.layer_timer = refuse
        cpu_dispatch.time_series = refuse
    else:  # a quiet machine's timing (real timings on a busy one are left to the bytes and not cached)
        cpu_dispatch.time_series = lambda first, second, budget=0: ([2.0] * 9, [1.0] * 9)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128))
    nmcompile.annotate(model, "sr_ste:2:4")
    nmcompile.finalize(model)
    model.eval()
    x = torch.randn(3, 256)
    with torch.no_grad():
        out = torch.compile(model, backend="nmsparse", dynamic=False, options={"inner": "eager"})(x)
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    report = nmcompile.deploy_report(model)
    print(json.dumps({name: [d.kernel, d.max_tokens, [list(r) for r in d.ratios], d.reason] for name, d in report.items()}))
""")


@needs_kernel
def test_a_second_process_compiles_the_same_layers_without_timing():
    def run(mode):
        done = subprocess.run([sys.executable, "-c", COMPILE, mode], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run("time")
    assert len(cache_files()) == 2  # one entry per shape, each with the compiled graph's token count
    second = run("refuse")  # its timer raises: every decision comes from the files
    assert first.keys() == second.keys() == {"0.weight", "2.weight"}
    for name in first:
        assert second[name][:3] == first[name][:3]  # kernel, range and the measured ratios
        assert "earlier process" in second[name][3] and "earlier process" not in first[name][3]
        assert f"on {decision_cache.describe_cpu(decision_cache.cpu_identity())}, host " in second[name][3]


def test_the_key_holds_what_decides_the_measurement():
    base = entry_key()
    for change in (dict(threads=1), dict(dtype=torch.bfloat16), dict(out_features=128), dict(bias=False),
                   dict(isa="avx512"), dict(ladder=(1,)), dict(packed_only=True), dict(method=99)):
        assert decision_cache.path_of(entry_key(**change)) != decision_cache.path_of(base), change
    assert base["cpu"] == decision_cache.cpu_model() and base["torch"] == torch.__version__
    assert base["kernel"] == cpu24.library_name() and base["nmcompile"]
    decision_cache.store(entry_key(threads=1), RUNGS)
    assert decision_cache.load(entry_key(threads=1)) == RUNGS
    assert decision_cache.load(entry_key(threads=2)) is None


def test_a_file_is_written_whole_and_read_back():
    path = decision_cache.store(entry_key(), RUNGS)
    assert path.parent == decision_cache.cache_root() / "cpu24" and cache_files() == [path.name]  # no temp left
    assert json.loads(path.read_text())["key"] == entry_key()
    assert decision_cache.load(entry_key()) == RUNGS


@pytest.mark.parametrize("content", ["{not json", "[]", '{"key": 1, "rungs": []}', "", '{"rungs": [[1, 2.0, true]]}'])
def test_a_corrupt_file_is_ignored_with_a_warning_and_replaced(content, no_timing, monkeypatch):
    key = entry_key(threads=torch.get_num_threads())
    path = decision_cache.path_of(key)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.warns(UserWarning, match="not a valid entry"):
        assert decision_cache.load(key) is None
    # the dispatch then times the layer and writes a good file over the bad one
    monkeypatch.setattr(cpu_dispatch, "layer_timer", lambda *args: lambda tokens: ([2.0] * 9, [1.0] * 9))
    with pytest.warns(UserWarning, match="not a valid entry"):
        max_tokens, ratios = cpu_dispatch.sparse_range(256, 512, torch.float32, True, "avx2", ladder=(1, 2, 4))
    assert max_tokens == 4 and ratios == ((1, 2.0), (2, 2.0), (4, 2.0))
    assert decision_cache.load(key) == ((1, 2.0, True), (2, 2.0, True), (4, 2.0, True))


def test_a_file_holding_another_key_is_not_taken():
    path = decision_cache.store(entry_key(), RUNGS)
    entry = json.loads(path.read_text())
    entry["key"]["torch"] = "0.0"  # e.g. copied from another machine or version
    path.write_text(json.dumps(entry))
    with pytest.warns(UserWarning, match="holds another key"):
        assert decision_cache.load(entry_key()) is None


@pytest.mark.parametrize("value", ["off", "0", "false", "NO"])
def test_the_cache_can_be_turned_off(value, monkeypatch):
    monkeypatch.setenv("NMCOMPILE_DECISION_CACHE", value)
    assert decision_cache.store(entry_key(), RUNGS) is None and cache_files() == []
    assert decision_cache.load(entry_key()) is None


def test_an_unknown_switch_value_says_what_is_accepted(monkeypatch):
    monkeypatch.setenv("NMCOMPILE_DECISION_CACHE", "sometimes")
    with pytest.raises(ValueError, match="NMCOMPILE_DECISION_CACHE='sometimes' is not understood; set it to 'off'"):
        decision_cache.load(entry_key())


def test_the_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NMCOMPILE_CACHE_DIR", str(tmp_path / "mine"))
    assert decision_cache.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("NMCOMPILE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert decision_cache.cache_root() == tmp_path / "xdg" / "nmcompile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert decision_cache.cache_root() == tmp_path / "home" / ".cache" / "nmcompile"


def test_a_folder_that_cannot_be_written_is_a_warning(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NMCOMPILE_CACHE_DIR", str(blocker))  # a file where the folder should be
    with pytest.warns(UserWarning, match="cannot write the decision cache"):
        assert decision_cache.store(entry_key(), RUNGS) is None


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b'{"key": "\xe9t\xe9"}', b"\x00" * 64,
                                     "overflow", b"[" * 100000])
def test_a_damaged_file_is_a_miss_with_one_warning_never_a_crash(content, no_timing, monkeypatch):
    """Bytes that are not UTF-8 (a damaged disk page), a number that overflows, nesting too deep to
    parse: each is a miss with one warning, then the layer is timed and the file replaced."""
    key = entry_key(threads=torch.get_num_threads())
    path = decision_cache.path_of(key)
    path.parent.mkdir(parents=True)
    if content == "overflow":  # the right key, a token count too large for an int
        content = json.dumps({"key": key, "rungs": [[1, 2.0, True]]}).replace('[1, 2.0', '[1e400, 2.0').encode()
    path.write_bytes(content)
    with pytest.warns(UserWarning, match="not a valid entry") as caught:
        assert decision_cache.load(key) is None
    assert len(caught) == 1
    monkeypatch.setattr(cpu_dispatch, "layer_timer", lambda *args: lambda tokens: ([2.0] * 9, [1.0] * 9))
    with pytest.warns(UserWarning, match="not a valid entry"):
        max_tokens, _ = cpu_dispatch.sparse_range(256, 512, torch.float32, True, "avx2", ladder=(1, 2, 4))
    assert max_tokens == 4 and decision_cache.load(key) == ((1, 2.0, True), (2, 2.0, True), (4, 2.0, True))


ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse sse2 avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vbmi2 avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
"""
ZEN3 = ZEN5.replace("cpu family\t: 26", "cpu family\t: 25").replace("model\t\t: 2", "model\t\t: 1").replace(
    " avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vbmi2 avx512_vnni", "")


def as_cpu(monkeypatch, cpuinfo: str):
    monkeypatch.setattr(decision_cache, "cpu_identity", lambda: decision_cache.parse_cpuinfo(cpuinfo))


def test_the_key_names_the_cpu_beyond_its_model_name(monkeypatch):
    """'AMD EPYC' names a Zen 5 with AVX-512 and a Zen 3 with AVX2 alike: vendor, family, model,
    stepping and the ISA flags tell them apart, so an entry tuned on one is never used on the other."""
    zen5 = decision_cache.parse_cpuinfo(ZEN5)
    assert zen5 == {"vendor": "AuthenticAMD", "family": "26", "model": "2", "stepping": "1", "name": "AMD EPYC",
                    "flags": ["avx", "avx2", "avx512_bf16", "avx512_vbmi2", "avx512_vnni", "avx512bw", "avx512dq",
                              "avx512f", "avx512vl", "f16c", "fma"]}
    as_cpu(monkeypatch, ZEN5)
    tuned_on_zen5 = entry_key()
    decision_cache.store(tuned_on_zen5, RUNGS)
    assert decision_cache.load(entry_key()) == RUNGS
    for other in (ZEN3, ZEN5.replace("stepping\t: 1", "stepping\t: 0"), ZEN5.replace(" avx512_bf16", ""),
                  ZEN5.replace("AuthenticAMD", "GenuineIntel", 1)):
        as_cpu(monkeypatch, other)
        assert entry_key()["cpu"] == "AMD EPYC"  # the same name
        assert decision_cache.path_of(entry_key()) != decision_cache.path_of(tuned_on_zen5)
        assert decision_cache.load(entry_key()) is None  # a miss: timed on this machine


def test_without_cpuinfo_the_platform_and_the_kernel_s_isas_name_the_cpu(monkeypatch):
    identity = decision_cache.parse_cpuinfo("")
    assert identity["name"] and identity["vendor"] and identity["flags"] == sorted(cpu24.isas())


def test_a_cached_decision_names_the_machine_that_measured_it(monkeypatch, no_timing):
    as_cpu(monkeypatch, ZEN3)
    key = entry_key(threads=torch.get_num_threads())
    decision_cache.store(key, RUNGS)
    max_tokens, ladder = cpu_dispatch.sparse_ladder(256, 512, torch.float32, True, "avx2", ladder=(1, 2, 4))
    how = cpu_dispatch.provenance(ladder)
    assert max_tokens == 2 and ladder.source == "cached"
    assert "measured by an earlier process on AMD EPYC (AuthenticAMD family 25 model 1 stepping 1; avx avx2 f16c fma)" in how
    assert f"host {platform.node()}" in how and str(decision_cache.cache_root()) in how
