"""Packed-only 2:4 weights on the CPU: no dense copy, and everything that reads the weight still works.

Eager and compiled forward, state_dict and packed checkpoints (loaded into a meta-device model, in
this process and a fresh one), check, in-place writes, ONNX export (a clear error, then after
unpacking), GPT-2's Conv1D weights, and torch.export + AOTInductor in a fresh process.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile.deploy import PackedLinearWeight, load_packed, pack_state_dict, pack_weights, unpack_weights
from nmcompile.kernels import cpu24

from models import packed_test_model as finalized, packed_test_build as build  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")




def dense_bytes(model, names):
    params = dict(model.named_parameters())
    return sum(params[n].numel() * params[n].element_size() for n in names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_only_model_computes_the_same_function_with_about_half_the_bytes(dtype):
    model = finalized(dtype)
    x = torch.randn(3, 5, 64).to(dtype)
    with torch.no_grad():
        expected = model(x)
    before = dense_bytes(model, ["0.weight", "2.weight"])
    decisions = pack_weights(model, measure=False)
    assert set(decisions) == {"0.weight", "2.weight"} and all(d.kernel == "cpu24" for d in decisions.values())
    weights = [model[0].weight, model[2].weight]
    assert all(isinstance(w, PackedLinearWeight) and not w.requires_grad for w in weights)
    assert isinstance(model[3].weight, nn.Parameter) and not isinstance(model[3].weight, PackedLinearWeight)
    resident = sum(w.nbytes_packed for w in weights)
    assert resident / before <= (0.54 if dtype == torch.float32 else 0.57), resident / before
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    with torch.no_grad():
        with torch.profiler.profile() as prof:
            eager = model(x)
        compiled = torch.compile(model, backend="nmsparse")(x)
    assert sum(e.key == "nmsparse::cpu24_linear" for e in prof.key_averages()) == 1  # both layers on the kernel
    torch.testing.assert_close(eager, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(compiled, expected, rtol=tol, atol=tol)
    assert nmcompile.check(model).ok
    assert [d.kernel for d in nmcompile.deploy_report(model).values()] == ["cpu24", "cpu24"]


def test_calls_above_the_measured_range_unpack_for_the_call():
    model = finalized()
    pack_weights(model, measure=False)
    layer = model[0]
    x = torch.randn(7, 64)
    with torch.no_grad():
        sparse = layer(x)
        layer.weight.max_tokens = 4  # as if measured: 7 rows take the dense GEMM
        dense = layer(x)
        torch.testing.assert_close(dense, sparse, rtol=1e-5, atol=1e-5)
        assert torch.equal(dense, torch.nn.functional.linear(x, layer.weight.dense(), layer.bias))  # dense, bit for bit
        assert torch.equal(layer(x[:4]), sparse[:4])  # 4 rows: the kernel


def test_packed_checkpoint_loads_into_a_meta_model_without_dense_weights(tmp_path):
    model = finalized()
    pack_weights(model, measure=False)
    state = pack_state_dict(model.state_dict())
    assert state["0.weight"].shape == (128, 32) and state["0.weight.nm24_meta"].shape == (128, 4)
    assert state["3.weight"].shape == (10, 48)  # dense head
    torch.save(state, tmp_path / "packed.pt")
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
    with torch.device("meta"):
        fresh = build()
    load_packed(fresh, torch.load(tmp_path / "packed.pt", weights_only=True))
    assert isinstance(fresh[0].weight, PackedLinearWeight) and not fresh[3].weight.is_meta
    assert set(nmcompile.deploy_report(fresh)) == {"0.weight", "2.weight"}
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), expected)
    torch.save(x, tmp_path / "x.pt")
    torch.save(expected, tmp_path / "y.pt")
    script = textwrap.dedent(f"""
        import torch
        from torch import nn
        from nmcompile.deploy import load_packed
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 48), nn.Linear(48, 10))
        load_packed(model, torch.load({str(tmp_path / 'packed.pt')!r}, weights_only=True))
        x, y = torch.load({str(tmp_path / 'x.pt')!r}), torch.load({str(tmp_path / 'y.pt')!r})
        with torch.no_grad():
            torch.testing.assert_close(model(x), y)
            torch.testing.assert_close(torch.compile(model, backend="nmsparse")(x), y)
        print("resumed", type(model[0].weight).__name__)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "resumed PackedLinearWeight" in done.stdout, done.stderr[-2000:]


def test_load_packed_names_what_does_not_fit():
    model = finalized()
    state = pack_state_dict(model.state_dict())
    wrong = build()
    wrong[0] = nn.Linear(32, 128)
    with pytest.raises(ValueError, match=r"0.weight holds a packed 2:4 weight of shape \[128, 64\], but the model's 0.weight is \[128, 32\]"):
        load_packed(wrong, state)
    damaged = {k: v for k, v in state.items() if k != "2.weight"}
    with pytest.raises(ValueError, match="2.weight.nm24_meta has no values entry"):
        load_packed(build(), damaged)
    lost = type(state)((k, v) for k, v in state.items() if k != "2.weight.nm24_meta")
    lost._metadata = state._metadata  # the record of what was packed, as torch.save keeps it
    with pytest.raises(ValueError, match="damaged: 2.weight was written packed but its .nm24_meta entry is missing"):
        load_packed(build(), lost)


def test_writes_are_refused_and_unpack_gives_dense_weights_back():
    model = finalized()
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    pack_weights(model, measure=False)
    with pytest.raises(RuntimeError, match="would write into a packed 2:4 weight.*unpack_weights"):
        with torch.no_grad():
            model[0].weight.add_(1.0)
    assert sorted(unpack_weights(model)) == ["0.weight", "2.weight"]
    for name, param in model.named_parameters():
        assert type(param) is nn.Parameter and torch.equal(param, dense[name])


@pytest.mark.slow
def test_onnx_export_says_to_unpack_then_works():
    pytest.importorskip("onnxruntime")
    model = finalized()
    pack_weights(model, measure=False)
    with pytest.raises(ValueError, match="held packed only.*nmcompile.deploy.unpack_weights"):
        nmcompile.export_onnx(model, (torch.randn(2, 64),), "unused.onnx")
    unpack_weights(model)
    import tempfile, os

    with tempfile.TemporaryDirectory() as tmp:
        report = nmcompile.export_onnx(model, (torch.randn(2, 64),), os.path.join(tmp, "m.onnx"))
    assert report.check.ok and len(report.initializers) == 2 and report.max_abs_diff < 1e-4


@pytest.mark.slow
def test_gpt2_conv1d_weights_are_packed_as_their_transpose():
    transformers = pytest.importorskip("transformers")
    from models import _gpt2

    model = _gpt2(transformers)
    nmcompile.annotate(model, "ste:2:4")
    nmcompile.finalize(model)
    model.eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    decisions = pack_weights(model, measure=False)
    assert len(decisions) == 8 and all(d.kernel == "cpu24" for d in decisions.values())
    attn = model.transformer.h[0].attn.c_attn.weight
    assert isinstance(attn, PackedLinearWeight) and attn.transposed and attn.shape == (32, 96)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.compile(model, backend="nmsparse")(ids).logits, expected, atol=1e-5, rtol=1e-4)
    state = pack_state_dict(model.state_dict())  # written packed as their transpose, without unpacking
    assert state["transformer.h.0.attn.c_attn.weight"].shape == (96, 16)
    assert len(state._metadata["nmcompile.nm24"]["transposed"]) == 8
    dense = nmcompile.deploy.unpack_state_dict(state)
    for name in decisions:
        assert torch.equal(dense[name], model.get_parameter(name).dense())  # [in, out] again
    fresh = _gpt2(transformers)
    load_packed(fresh, state)
    attn = fresh.transformer.h[0].attn.c_attn.weight
    assert isinstance(attn, PackedLinearWeight) and attn.transposed and attn.shape == (32, 96)
    assert nmcompile.deploy.deploy_report(fresh).keys() == decisions.keys()
    assert all(r.dim == 0 for r in nmcompile.finalize(fresh).values())
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(ids).logits, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_torch_export_and_aotinductor_package_keep_the_kernel_in_a_fresh_process(tmp_path):
    model = finalized()
    pack_weights(model, measure=False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = model(x)
    program = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "model.pt2"))
    torch.save((x, expected), tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch
        from nmcompile.kernels import cpu24
        assert cpu24.status().available  # registers nmsparse::cpu24_linear before the package loads
        runner = torch._inductor.aoti_load_package({path!r})
        x, y = torch.load({str(tmp_path / 'io.pt')!r})
        with torch.profiler.profile() as prof:
            out = runner(x)
        torch.testing.assert_close(out, y, rtol=1e-5, atol=1e-5)
        print("calls", sum(e.count for e in prof.key_averages() if e.key == "nmsparse::cpu24_linear"))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "calls 2" in done.stdout, done.stdout[-1000:] + done.stderr[-2000:]


def test_measured_range_compares_the_kernel_with_unpacking_plus_dense(monkeypatch):
    from nmcompile.kernels.dispatch import cpu as cpu_dispatch

    calls = []

    def fake(out_f, in_f, dtype, bias, isa, threads, ladder, packed_only=False):
        calls.append(packed_only)
        return cpu_dispatch.Ladder(((1, 3.0, True), (2, 2.5, True), (4, 1.5, True), (8, 0.9, False)))

    monkeypatch.setattr(cpu_dispatch, "_ratios", fake)
    model = finalized()
    decisions = pack_weights(model)
    assert calls and all(calls)  # the alternative to a packed-only weight is unpack + dense, not dense
    assert all(d.max_tokens == 4 and d.token_range == "1 to 4" for d in decisions.values())
    assert model[0].weight.max_tokens == 4
