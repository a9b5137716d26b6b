"""A saved deployed directory loads back as deployed, in a fresh process: ``load_pretrained`` (dense, or
streamed straight into packed 2:4 weights), and ``from_pretrained`` + ``restore``; mismatches are named."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import nmcompile
from nmcompile.deploy import PackedLinearWeight, load_pretrained, pack_weights, save_pretrained
from nmcompile.checkpoint import restore
from nmcompile.kernels import cpu24
from models import _gpt2, magnitude_2_4, tiny_llama

transformers = pytest.importorskip("transformers")
kernel = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")


def saved(tmp_path, kind, packed=True, **sizes):
    """A 2:4 model saved; ``packed=False``: without ``model_packed.pt``, so a packed load streams the safetensors."""
    torch.manual_seed(0)
    model = _gpt2(transformers) if kind == "gpt2" else tiny_llama(transformers, **sizes)
    report = magnitude_2_4(model)
    save_pretrained(model, tmp_path / kind, packed=packed)
    return model, report, tmp_path / kind


def run(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@kernel
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_saved_directory_loads_as_deployed_in_a_fresh_process(tmp_path, kind):
    model, report, path = saved(tmp_path, kind)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
    torch.save((ids, expected), tmp_path / "io.pt")
    out = run(f"""
        import torch, transformers, nmcompile
        from nmcompile.deploy import PackedLinearWeight, load_pretrained, restore
        path, (ids, expected) = {str(path)!r}, torch.load({str(tmp_path / 'io.pt')!r})
        plain = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        assert not nmcompile.check(plain), "a plain load has no records"
        restore(plain, path)                                # the one documented call after from_pretrained
        print("restored", nmcompile.check(plain).ok, len(nmcompile.check(plain)))
        dense = load_pretrained(path)
        with torch.no_grad():
            torch.testing.assert_close(dense(ids).logits, expected, rtol=0, atol=0)
            compiled = torch.compile(dense, backend="nmsparse", options={{"inner": "aot_eager"}})(ids).logits  # deploys
            # without finalize (the deploy passes decide each weight; Inductor's code for them: tests/deploy/test_deploy.py)
        torch.testing.assert_close(compiled, expected, rtol=1e-4, atol=1e-4)
        decided = [d for d in nmcompile.deploy_report(dense).values() if d != "not compiled yet"]
        print("dense", nmcompile.check(dense).ok, len(nmcompile.check(dense)), len(decided))
        packed = load_pretrained(path, packed=True)
        held = [n for n, p in packed.named_parameters() if isinstance(p, PackedLinearWeight)]
        with torch.no_grad():
            torch.testing.assert_close(packed(ids).logits, expected, rtol=1e-4, atol=1e-4)
        head, embed = packed.get_output_embeddings().weight, packed.get_input_embeddings().weight
        print("packed", nmcompile.check(packed).ok, len(nmcompile.check(packed)), len(held), head is embed,
              packed.training)
        half, half_packed = load_pretrained(path, dtype=torch.bfloat16), load_pretrained(path, packed=True,
                                                                                          dtype=torch.bfloat16)
        with torch.no_grad():  # bf16: the kernel accumulates in fp32, the dense GEMM in its own order
            torch.testing.assert_close(half_packed(ids).logits, half(ids).logits, rtol=2e-2, atol=2e-2)
        print("bf16", half_packed.get_input_embeddings().weight.dtype, nmcompile.check(half_packed).ok)
    """)
    n = len(report)
    assert f"restored True {n}" in out and f"dense True {n} {n}" in out  # the deploy route decided each weight
    assert f"packed True {n} {n} {kind == 'gpt2'} False" in out  # GPT-2's tied head stays tied
    assert "bf16 torch.bfloat16 True" in out


@kernel
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("packed_file", [False, True])
def test_streamed_packing_makes_the_layout_pack_weights_makes(tmp_path, kind, packed_file, monkeypatch):
    from nmcompile.checkpoint import streaming

    model, report, path = saved(tmp_path, kind, packed=packed_file)
    monkeypatch.setattr(streaming, "chunk_budget", lambda elements: 16)  # one row group / word column per chunk
    packed = load_pretrained(path, packed=True)
    pack_weights(model, measure=False)
    for name in report:
        ours, theirs = packed.get_parameter(name), model.get_parameter(name)
        assert isinstance(ours, PackedLinearWeight) and ours.transposed == (kind == "gpt2")
        assert torch.equal(ours.values, theirs.values) and torch.equal(ours.bits, theirs.bits), name
    assert nmcompile.deploy_report(packed).keys() == set(report)


def test_restore_names_weights_that_are_not_what_the_record_says(tmp_path):
    _, _, path = saved(tmp_path, "llama")
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    with torch.no_grad():
        plain.model.layers[1].mlp.up_proj.weight.fill_(1.0)
    with pytest.raises(ValueError, match=r"nothing was recorded:\n  model.layers.1.mlp.up_proj.weight: 2048/2048 groups "
                                         r"along dim 1 keep more than 2 of 4\n.*finalize\(model, pattern='2:4'\)"):
        restore(plain, path)
    assert not nmcompile.check(plain)
    with pytest.raises(ValueError, match="has no nmcompile layout record.*finalize\\(model, pattern='2:4'\\)"):
        restore(plain, tmp_path)
    other = tiny_llama(transformers, layers=1)
    with pytest.raises(ValueError, match="model.layers.1.self_attn.q_proj.weight is not a parameter of LlamaForCausalLM"):
        restore(other, path)


@kernel
def test_a_record_that_does_not_fit_the_files_stops_the_load(tmp_path):
    _, _, path = saved(tmp_path, "llama", packed=False)
    record = json.loads((path / "nmcompile.json").read_text())
    record["weights"]["lm_head.weight"] = {"pattern": "2:4", "dim": 1, "shape": [256, 64]}  # dense in the file
    (path / "nmcompile.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"lm_head.weight in .*model.safetensors: 4096/4096 groups along dim 1 keep "
                                         r"more than 2 of 4.*different saves"):
        load_pretrained(path, packed=True)
    with pytest.raises(ValueError, match=r"lm_head.weight: 4096/4096 groups along dim 1"):
        load_pretrained(path)
    record["weights"]["lm_head.weight"]["shape"] = [64, 256]
    (path / "nmcompile.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"lm_head.weight is \[256, 64\] in .*, the record says \[64, 256\]"):
        load_pretrained(path, packed=True)
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match="parameters of LlamaForCausalLM that no weights file holds: "
                                         "model.layers.0.mlp.up_proj.weight; the directory was written for another "
                                         "model, or is incomplete"):  # said before anything is read
        load_pretrained(path, packed=True)
    (path / "nmcompile.json").unlink()
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no nmcompile layout record"):
        load_pretrained(path, packed=True)
    with pytest.raises(ValueError, match="has no config.json, so it is not a Hugging Face model directory"):
        load_pretrained(tmp_path)


RSS_SCRIPT = """
import gc, json, sys
from nmcompile.deploy import PackedLinearWeight, load_pretrained

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def resident_bytes(model):
    storages = {}
    for t in list(model.parameters()) + list(model.buffers()):
        for part in (t.values, t.bits) if isinstance(t, PackedLinearWeight) else (t,):
            storages[part.untyped_storage().data_ptr()] = part.untyped_storage().nbytes()
    return sum(storages.values())

load_pretrained(sys.argv[1], packed=True)  # imports, the kernel's library, first-call caches: the baseline
gc.collect()
try:
    open("/proc/self/clear_refs", "w").write("5")  # the peak counts again from here
except OSError as err:
    print(json.dumps({"skip": f"cannot reset the peak resident memory: {err}"}))
    sys.exit(0)
baseline = status("VmRSS")
model = load_pretrained(sys.argv[2], packed=True, measure=False)  # the streaming; timing's scratch is bounded apart
print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "packed": resident_bytes(model),
                  "dense": sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


@kernel
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak resident memory from /proc")
@pytest.mark.parametrize("dtype, source", [(torch.float32, "safetensors"), (torch.bfloat16, "safetensors"),
                                           (torch.bfloat16, "model_packed.pt")])
def test_the_packed_load_peaks_at_the_packed_model_s_bytes(tmp_path, dtype, source):
    torch.manual_seed(0)
    tiny = tiny_llama(transformers)
    magnitude_2_4(tiny)
    save_pretrained(tiny.to(dtype), tmp_path / "tiny")
    model = tiny_llama(transformers, hidden=512, intermediate=1536, layers=4, vocab=1024)  # 50 MB dense in fp32
    magnitude_2_4(model)
    save_pretrained(model.to(dtype), tmp_path / "model", packed=source == "model_packed.pt")
    del model
    if source == "model_packed.pt":  # the folder shipped for CPU serving: the packed file alone
        for dense in tmp_path.glob("model/*.safetensors"):
            dense.unlink()
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "tiny"), str(tmp_path / "model")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in measured:
        pytest.skip(measured["skip"])
    grown = measured["peak"] - measured["baseline"]
    print(f"{dtype}: peak {grown / 2**20:.1f} MiB over the baseline, packed model {measured['packed'] / 2**20:.1f} MiB "
          f"({grown / measured['packed']:.3f}x), dense {measured['dense'] / 2**20:.1f} MiB")
    assert measured["packed"] < 0.62 * measured["dense"]
    assert grown <= 1.15 * measured["packed"], measured


@kernel
def test_loading_from_several_threads_builds_on_meta_for_the_loading_thread_only(tmp_path):
    """Two packed loads at once (the second starts building while the first builds and ends its build after the
    first load returned), and a model built in another thread while a load builds its own: every model gets what
    it would alone, and nothing of PyTorch is left replaced (nor replaced during the load)."""
    import threading
    from torch import nn

    model, _, path = saved(tmp_path, "llama")
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
        expected_bf16 = load_pretrained(path, dtype=torch.bfloat16)(ids).logits
    register, default_dtype = nn.Module.register_parameter, torch.get_default_dtype()
    first_inside, second_inside, first_done = threading.Event(), threading.Event(), threading.Event()
    seen, loaded, failed = {}, {}, []

    class Blocking(transformers.LlamaForCausalLM):  # model_class: stops each load inside its model's construction
        def __init__(self, config):
            super().__init__(config)
            if threading.current_thread().name == "first":
                first_inside.set()  # meanwhile the main thread builds a model, then the second load starts
                assert second_inside.wait(60)
            else:
                second_inside.set()
                assert first_done.wait(60)  # the second load's construction ends after the first load

    def load(name, dtype):
        try:
            loaded[name] = load_pretrained(path, packed=True, dtype=dtype, model_class=Blocking, measure=False)
        except BaseException as err:  # noqa: BLE001 - raised again in the main thread
            failed.append(err)
        finally:
            if name == "first":
                first_done.set()

    first = threading.Thread(target=load, args=("first", torch.bfloat16), name="first")
    second = threading.Thread(target=load, args=("second", None), name="second")
    try:
        first.start()
        assert first_inside.wait(60)
        seen["other"] = tiny_llama(transformers)  # a model built in this thread while the first load builds its own
        seen["register"], seen["dtype"] = nn.Module.register_parameter, torch.get_default_dtype()
        second.start()
        first.join(120)
        second.join(120)
        assert not failed, failed
        assert seen["register"] is register and nn.Module.register_parameter is register
        assert seen["dtype"] == torch.get_default_dtype() == default_dtype
    finally:  # what a failure left replaced must not reach the tests after this one
        if nn.Module.register_parameter is not register:
            nn.Module.register_parameter = register
        torch.set_default_dtype(default_dtype)
    built_meanwhile = list(seen["other"].named_parameters())
    assert [n for n, p in built_meanwhile if p.is_meta or p.dtype != default_dtype] == []
    after = nn.Linear(4, 4)  # a module built after both loads
    assert not after.weight.is_meta and after.weight.dtype == default_dtype
    assert loaded["first"].get_input_embeddings().weight.dtype == torch.bfloat16
    assert isinstance(loaded["second"].model.layers[0].mlp.up_proj.weight, PackedLinearWeight)
    for name, m in loaded.items():
        assert not [n for n, t in list(m.named_parameters()) + list(m.named_buffers()) if t.is_meta], name
        assert nmcompile.check(m).ok
    rotary = dict(model.named_buffers())
    for name, buffer in loaded["second"].named_buffers():  # computed as at construction, not read from the files
        torch.testing.assert_close(buffer, rotary[name], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(loaded["second"](ids).logits, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(loaded["first"](ids).logits, expected_bf16, rtol=2e-2, atol=2e-2)


@kernel
def test_a_loaded_packed_model_converted_to_bf16_has_the_ranges_of_one_loaded_in_bf16(tmp_path, monkeypatch):
    from nmcompile.kernels.dispatch import cpu as cpu_dispatch

    ranges, asked = {torch.float32: 256, torch.bfloat16: 16}, []

    def fake(out_f, in_f, dtype, bias, isa, threads, ladder, packed_only=False):  # no kernel is timed
        asked.append((out_f, in_f, dtype, bias, isa, packed_only))
        top = ranges[dtype]
        return cpu_dispatch.Ladder(tuple((t, 3.0 if t <= top else 0.8, t <= top) for t in ladder if t <= 2 * top))

    monkeypatch.setattr(cpu_dispatch, "_ratios", fake)
    _, report, path = saved(tmp_path, "llama")
    direct = load_pretrained(path, packed=True, dtype=torch.bfloat16)
    wanted, asked_direct = nmcompile.deploy_report(direct), set(asked)
    model = load_pretrained(path, packed=True)
    assert {d.max_tokens for d in nmcompile.deploy_report(model).values()} == {256}
    asked.clear()
    model.to(torch.bfloat16)
    assert set(asked) == asked_direct
    converted = nmcompile.deploy_report(model)
    for name in report:
        assert model.get_parameter(name).max_tokens == direct.get_parameter(name).max_tokens == 16
        assert (converted[name].max_tokens, converted[name].ratios, converted[name].isa) == \
            (wanted[name].max_tokens, wanted[name].ratios, wanted[name].isa)
    with torch.no_grad():
        for tokens in (4, 40):  # 2 x 40 rows: above the range, unpacked for the dense GEMM
            ids = torch.randint(0, 256, (2, tokens // 2))
            # (model.to converts the rotary frequencies to bf16 too; the load keeps them in fp32)
            torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=2e-2, atol=2e-2)


@kernel
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_folder_holding_only_the_packed_file_loads_packed_as_the_safetensors_do(tmp_path, kind, monkeypatch):
    import shutil

    from nmcompile.checkpoint import streaming

    _, _, path = saved(tmp_path, kind)
    shipped = tmp_path / "cpu-only"
    shipped.mkdir()
    for name in ("config.json", "generation_config.json", "nmcompile.json", "model_packed.pt"):
        if (path / name).exists():
            shutil.copy(path / name, shipped / name)
    assert not list(shipped.glob("*.safetensors*"))
    ids = torch.randint(0, 256, (2, 12))
    (path / "model_packed.pt").unlink()  # the reference: the same weights streamed from the safetensors files
    for dtype in (None, torch.bfloat16):
        whole = load_pretrained(path, packed=True, measure=False, dtype=dtype)
        with monkeypatch.context() as patch:  # the packed entries go straight into the kernel's layout
            patch.setattr(streaming, "unpack", lambda *a, **k: pytest.fail("a packed entry was unpacked"))
            only = load_pretrained(shipped, packed=True, measure=False, dtype=dtype)
        held = {n: p for n, p in only.named_parameters() if isinstance(p, PackedLinearWeight)}
        assert held.keys() == {n for n, p in whole.named_parameters() if isinstance(p, PackedLinearWeight)} != set()
        for name, p in whole.state_dict().items():
            q = only.state_dict()[name]
            assert q.dtype == p.dtype and torch.equal(q.dense() if isinstance(q, PackedLinearWeight) else q,
                                                      p.dense() if isinstance(p, PackedLinearWeight) else p), name
        with torch.no_grad():
            assert torch.equal(only(ids).logits, whole(ids).logits)
        assert nmcompile.check(only).ok
        head, embed = only.get_output_embeddings().weight, only.get_input_embeddings().weight
        assert (head is embed) == (kind == "gpt2")  # a tied head stays tied
    with pytest.raises(ValueError, match=r"only in .*model_packed.pt .*packed=True"):
        load_pretrained(shipped)
    (shipped / "model_packed.pt").unlink()
    with pytest.raises(ValueError, match="holds no model.safetensors"):
        load_pretrained(shipped, packed=True)
