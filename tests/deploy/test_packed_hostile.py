"""Packed-only 2:4 weights under what users do to models: fine-tune after unpacking, inference mode,
``.data`` assignment, deepcopy, pickling, shared memory, dtype casts, and damaged packed state dicts.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile.deploy import PackedLinearWeight, pack_weights, unpack_weights
from nmcompile.kernels import cpu24

from models import packed_test_model as finalized, packed_test_build as build  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")




def packed(dtype=torch.float32):
    model = finalized(dtype)
    pack_weights(model, measure=False)
    return model


def test_unpacked_weights_train_as_before_packing():
    model = finalized()
    model[2].weight.requires_grad_(False)  # frozen by the user: stays frozen
    pack_weights(model, measure=False)
    unpack_weights(model)
    assert model[0].weight.requires_grad and not model[2].weight.requires_grad
    before = model[0].weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).square().sum().backward()
    optimizer.step()
    assert not torch.equal(model[0].weight, before)


def kernel_calls(fn):
    """``(result, {op: calls})`` of the 2:4 CPU ops ``fn()`` ran (the kernel, or the unpacking fallback)."""
    with torch.profiler.profile() as prof:
        result = fn()
    return result, {e.key: e.count for e in prof.key_averages() if e.key.startswith("nmsparse::cpu24")}


def test_inference_mode_runs_the_kernel_as_no_grad_does():
    model = packed()
    x = torch.randn(3, 64)
    weight = model[0].weight
    with torch.no_grad():
        expected, expected_calls = kernel_calls(lambda: model(x))
        product = x @ weight.t()
    with torch.inference_mode():
        out, calls = kernel_calls(lambda: model(x))
        (transposed, detached), more = kernel_calls(lambda: (x @ weight.t(), torch.matmul(x, weight.detach().t())))
        vector, _ = kernel_calls(lambda: model[0](x[0]))
    assert calls == expected_calls == {"nmsparse::cpu24_linear": 2}  # never unpacked
    assert more == {"nmsparse::cpu24_linear": 2}
    assert torch.equal(out, expected) and torch.equal(transposed, product) and torch.equal(detached, product)
    with torch.no_grad():
        torch.testing.assert_close(vector, model[0](x[:1])[0])


def test_assigning_data_of_a_packed_weight_is_refused_not_ignored():
    model = packed()
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = model(x)
    with pytest.raises(RuntimeError, match=r"\.data of a packed 2:4 weight \[128, 64\] would be ignored.*unpack_weights"):
        model[0].weight.data = torch.zeros(128, 64)
    vector = torch.nn.utils.parameters_to_vector(model.parameters())
    with pytest.raises(RuntimeError, match="would be ignored"):
        torch.nn.utils.vector_to_parameters(torch.zeros_like(vector), model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert isinstance(model[0].weight.data, PackedLinearWeight)  # reading .data still works


def test_deepcopy_of_a_packed_model_is_packed_equal_and_independent():
    import copy

    model = packed()
    twin = copy.deepcopy(model)
    x = torch.randn(3, 64)
    weight, copied = model[0].weight, twin[0].weight
    assert isinstance(copied, PackedLinearWeight) and isinstance(copied, nn.Parameter) and not copied.requires_grad
    assert copied.values.data_ptr() != weight.values.data_ptr() and copied.bits.data_ptr() != weight.bits.data_ptr()
    assert (copied.weight_shape, copied.max_tokens, copied.isa, copied.transposed) == \
        (weight.weight_shape, weight.max_tokens, weight.isa, weight.transposed)
    with torch.no_grad():
        assert torch.equal(twin(x), model(x))
    assert nmcompile.deploy_report(twin) == nmcompile.deploy_report(model) and nmcompile.check(twin).ok
    unpack_weights(twin)  # the copy's trainable flag came along; the original stays packed
    assert twin[0].weight.requires_grad and isinstance(model[0].weight, PackedLinearWeight)
    shared = nn.ModuleDict({"a": model[0], "b": model[0]})  # the same weight twice stays one weight
    both = copy.deepcopy(shared)
    assert both["a"].weight is both["b"].weight


def _fresh_process(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=600)


def test_a_pickled_packed_model_runs_in_a_fresh_process(tmp_path):
    model = packed()
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.save((model, x, model(x)), tmp_path / "model.pt")
    done = _fresh_process(f"""
        import torch
        from torch import nn
        import nmcompile
        model, x, expected = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        weight = model[0].weight
        assert type(weight).__name__ == "PackedLinearWeight" and isinstance(weight, nn.Parameter)
        assert nmcompile.deploy_report(model)["0.weight"].kernel == "cpu24"  # its decision came along
        print("ran packed")
    """)
    assert done.returncode == 0 and "ran packed" in done.stdout, done.stderr[-2000:]


def test_share_memory_of_a_packed_model_shares_values_and_bits():
    # PyTorch's share_memory_ reads the storage of the wrapper, which has none: the process died (SIGSEGV)
    done = _fresh_process("""
        import torch
        from torch import nn
        import nmcompile
        from nmcompile.deploy import pack_weights
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 48))
        nmcompile.annotate(model, "sr_ste:2:4")
        nmcompile.finalize(model)
        pack_weights(model.eval(), measure=False)
        x = torch.randn(3, 64)
        with torch.no_grad():
            expected = model(x)
        assert model[2].weight.share_memory_() is model[2].weight and model[2].weight.is_shared()
        model.share_memory()
        weight = model[0].weight
        assert weight.is_shared() and weight.values.is_shared() and weight.bits.is_shared()
        assert isinstance(weight, nn.Parameter) and nmcompile.deploy_report(model)["0.weight"].kernel == "cpu24"
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        print("shared")
    """)
    assert done.returncode == 0 and "shared" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_packed_state_dict_loads_into_a_plain_model():
    model = packed()
    plain = build()
    plain.load_state_dict(model.state_dict())  # a dense target: reading the packed weight is no write into it
    assert type(plain[0].weight) is nn.Parameter
    assert torch.equal(plain[0].weight, model[0].weight.dense()) and torch.equal(plain[3].weight, model[3].weight)
    with pytest.raises(RuntimeError, match="would write into a packed 2:4 weight"):
        with torch.no_grad():
            model[0].weight.copy_(plain[0].weight)  # the other way is still refused


@pytest.mark.parametrize("route", ["module", "module with device", "tensor", "tensor under inference_mode"])
def test_dtype_conversion_converts_the_packed_values(route):
    import copy

    model = finalized()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    pack_weights(model, measure=False)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    if route.startswith("module"):
        model.to(torch.bfloat16) if route == "module" else model.to("cpu", torch.bfloat16)
        weight, run, expected = model[0].weight, model, reference
    else:
        with torch.inference_mode() if "inference_mode" in route else torch.no_grad():
            weight = model[0].weight.to(torch.bfloat16)
        bias = reference[0].bias

        def run(x):
            return torch.nn.functional.linear(x, weight, bias)

        def expected(x):
            return reference[0](x)

    assert isinstance(weight, PackedLinearWeight) and weight.dtype == weight.values.dtype == torch.bfloat16
    assert weight.isa == cpu24.best_isa(torch.bfloat16)
    with torch.no_grad():
        out, calls = kernel_calls(lambda: run(x))
        torch.testing.assert_close(out, expected(x), rtol=2e-2, atol=2e-2)
    assert calls == {"nmsparse::cpu24_linear": 2 if run is model else 1}
    if run is model:
        assert nmcompile.deploy_report(model)["0.weight"].kernel == "cpu24"  # the record came along


def test_a_dtype_the_kernel_cannot_take_is_named():
    model = packed()
    with pytest.raises(RuntimeError, match=r"cannot convert a packed 2:4 weight \[128, 64\] from torch.float32 on cpu to "
                                           r"torch.float64.*float32, bfloat16 or float16.*unpack_weights"):
        model.double()
    dense = model[2].weight.double()  # reading one weight in float64 is a dense copy
    assert type(dense) is torch.Tensor and torch.equal(dense, model[2].weight.dense().double())


def test_a_cast_leaves_an_isa_that_does_not_take_the_new_dtype():
    weight = packed(torch.bfloat16)[0].weight
    weight = weight._with(isa="avx512_bf16")  # as packed on a CPU with AVX512-BF16
    assert weight.to(torch.float32).isa == cpu24.best_isa(torch.float32)  # it multiplies bf16 only
    assert weight.to(torch.bfloat16, copy=True).isa == "avx512_bf16"


#: the token range each dtype's fake timing gives (the kernel clearly faster up to it, slower at the next rung)
FAKE_RANGES = {torch.float32: 256, torch.bfloat16: 16, torch.float16: 8}


def fake_timing(monkeypatch) -> list:
    """Time no kernel: each shape's ladder is made up from its dtype (:data:`FAKE_RANGES`); the keys it was
    asked for, (out, in, dtype, bias, isa, packed_only), are listed in the list returned."""
    from nmcompile.kernels.dispatch import cpu as cpu_dispatch

    asked = []

    def fake(out_f, in_f, dtype, bias, isa, threads, ladder, packed_only=False):
        asked.append((out_f, in_f, dtype, bias, isa, packed_only))
        top = FAKE_RANGES[dtype]
        return cpu_dispatch.Ladder(tuple((t, 3.0 if t <= top else 0.8, t <= top) for t in ladder if t <= 2 * top))

    monkeypatch.setattr(cpu_dispatch, "_ratios", fake)
    return asked


@pytest.mark.parametrize("source, convert, target", [
    (torch.float32, lambda m: m.to(torch.bfloat16), torch.bfloat16),
    (torch.float32, lambda m: m.half(), torch.float16),
    (torch.bfloat16, lambda m: m.float(), torch.float32),
])
def test_a_dtype_conversion_decides_each_layer_s_range_for_the_new_dtype(monkeypatch, source, convert, target):
    import copy

    asked = fake_timing(monkeypatch)
    direct = finalized(target)
    pack_weights(direct)  # packed in the target dtype: what the converted model must equal
    wanted, asked_direct = nmcompile.deploy_report(direct), set(asked)
    model = finalized(source)
    reference = copy.deepcopy(model).to(target)
    pack_weights(model)
    assert model[0].weight.max_tokens == FAKE_RANGES[source]
    asked.clear()
    convert(model)
    assert set(asked) == asked_direct  # the same decision (cache) keys as packing in the new dtype
    report = nmcompile.deploy_report(model)
    for name, decision in report.items():
        weight = model.get_parameter(name)
        assert weight.dtype == target and weight.max_tokens == direct.get_parameter(name).max_tokens == FAKE_RANGES[target]
        assert (decision.max_tokens, decision.ratios, decision.isa, decision.token_range) == \
            (wanted[name].max_tokens, wanted[name].ratios, wanted[name].isa, wanted[name].token_range)
        assert f"converted from {source}" in decision.reason
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[target]
    with torch.no_grad():
        for tokens in (4, 64):  # inside the new range (the kernel) and above it (unpacked for a dense GEMM)
            x = torch.randn(tokens, 64).to(target)
            torch.testing.assert_close(model(x), reference(x), rtol=tol, atol=tol)


def test_a_range_that_was_not_timed_stays_untimed_through_a_conversion(monkeypatch):
    asked = fake_timing(monkeypatch)
    model = packed()  # measure=False: every token count
    model.to(torch.bfloat16)
    assert asked == [] and model[0].weight.max_tokens == -1
    assert nmcompile.deploy_report(model)["0.weight"].token_range == "1 and up"


def test_load_packed_reads_a_mixtral_checkpoint_with_3d_experts():
    transformers = pytest.importorskip("transformers")
    from nmcompile.deploy import load_packed, pack_state_dict, unpack_state_dict
    from nmcompile.state.records import deployed_of

    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM._from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.1)  # transformers leaves expert weights uninitialised outside from_pretrained
    nmcompile.annotate(model, "sr_ste:2:4")
    nmcompile.finalize(model)
    state = pack_state_dict(model.eval().state_dict())
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert state[experts].shape == (4, 64, 16)  # [experts, out, in/2]: what unpack_state_dict reads
    fresh = transformers.MixtralForCausalLM._from_config(config)  # (on meta, its rotary buffers would stay there)
    with pytest.warns(UserWarning, match=f"loaded dense.*{experts} \\(a 3-D weight"):
        load_packed(fresh, state)
    layer = fresh.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.weight, PackedLinearWeight)
    assert torch.equal(layer.mlp.experts.gate_up_proj, unpack_state_dict(state)[experts])
    assert deployed_of(layer.mlp.experts, "gate_up_proj").dim == -1 and nmcompile.check(fresh).ok
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    wrong = build()
    wrong[0] = nn.Linear(32, 128)
    with pytest.raises(ValueError, match=r"0.weight holds a packed 2:4 weight of shape \[128, 64\], but the model's "
                                         r"0.weight is \[128, 32\]"):
        load_packed(wrong, pack_state_dict(finalized().state_dict()))


def blocks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([nn.Linear(64, 64) for _ in range(3)]), nn.Linear(64, 10))
    nmcompile.annotate(model, "sr_ste:2:4", exclude=["1.*"])
    nmcompile.finalize(model)
    return model


def test_a_rebuilt_packed_dict_that_lost_a_metadata_entry_is_named_damaged():
    from nmcompile.deploy import load_packed, pack_state_dict, unpack_state_dict

    state = pack_state_dict(finalized().state_dict())
    rebuilt = {k: v for k, v in state.items() if k != "2.weight.nm24_meta"}  # no _metadata record any more
    with pytest.raises(ValueError, match="load_packed: the file is damaged: 2.weight was written packed but its "
                                         r"\.nm24_meta entry is missing.*found from the entries"):
        load_packed(build(), rebuilt)  # the model's 2.weight is [48, 128], the entry [48, 64]
    report = nmcompile.check(rebuilt)
    assert "2.weight: 2:4 along dim 1: 768/768 groups violate; if it was written packed, its .nm24_meta entry is " \
        "missing" in str(report)
    stacked = pack_state_dict(blocks().state_dict())
    rebuilt = {k: v for k, v in stacked.items() if k != "0.1.weight.nm24_meta"}
    for read in (unpack_state_dict, nmcompile.check):  # no model: the same layer of the other blocks tells
        with pytest.raises(ValueError, match=r"damaged: 0\.1\.weight was written packed but its metadata "
                                             r"0\.1\.weight\.nm24_meta is missing.*found from the entries"):
            read(rebuilt)
    whole = dict(stacked)  # rebuilt, nothing lost: the dense head is no suspect
    assert torch.equal(unpack_state_dict(whole)["1.weight"], stacked["1.weight"]) and nmcompile.check(whole)["0.2.weight"].ok
    fresh = blocks()
    load_packed(fresh, whole)
    assert isinstance(fresh[0][1].weight, PackedLinearWeight)
