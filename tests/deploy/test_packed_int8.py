"""``pack_weights(model, bits=8)``: finalized 2:4 weights held as int8 codes with a scale per row, computing in
the model's dtype, and the packed weight's promises kept for them (deepcopy, pickling, shared memory,
inference mode, casts, read-only), with checkpoints refused by name until they hold the scales."""

import copy
import io

import pytest
import torch

from nmcompile.state import records

import nmcompile
from nmcompile.deploy import PackedLinearWeight, pack_state_dict, pack_weights, unpack_weights
from nmcompile.kernels import cpu24

from models import packed_test_model as finalized  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")

LAYERS = (0, 2)  # the finalized linears of packed_test_model; its head (3) stays dense


def reference(model, x):
    """The model's output computed in float64 from each packed weight's dequantized value."""
    h = x.double()
    for i, module in enumerate(model):
        if isinstance(module, torch.nn.Linear):
            w = module.weight.dense() if isinstance(module.weight, PackedLinearWeight) else module.weight
            h = torch.nn.functional.linear(h, w.double(), module.bias.double())
        else:
            h = module(h)
    return h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_values_compute_the_dequantized_model_in_its_dtype(dtype):
    model = finalized(dtype)
    before = {i: model[i].weight.detach().float().clone() for i in LAYERS}
    decisions = pack_weights(model, bits=8, measure=False)
    assert set(decisions) == {"0.weight", "2.weight"} and all(d.kernel == "cpu24" for d in decisions.values())
    assert all("int8 values" in d.reason for d in decisions.values())
    for i in LAYERS:
        w = model[i].weight
        assert isinstance(w, PackedLinearWeight) and w.quantized and w.dtype == dtype
        assert w.values.dtype == torch.int8 and w.scales.dtype == torch.float32
        # within half a step of each row's grid (the bf16 model's dequantized weight rounded to bf16 again)
        step = w.scales[:, None] / 2 + (before[i].abs() * 2**-8 if dtype == torch.bfloat16 else 0)
        assert bool(((w.dense().float() - before[i]).abs() <= step * 1.0001).all()), i
        assert nmcompile.deploy.check(model).ok
    x = torch.randn(5, 64).to(dtype)
    with torch.no_grad():
        out = model(x)
    assert out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), reference(model, x), rtol=tol, atol=tol)


def test_int8_weights_are_about_five_bits_a_weight():
    model = finalized()
    pack_weights(model, measure=False)
    fp32 = {i: model[i].weight.nbytes_packed for i in LAYERS}
    pack_weights(model, bits=8, measure=False)  # packed weights are quantized in place
    for i in LAYERS:
        w = model[i].weight
        out_f, in_f = w.weight_shape
        padded = -(-out_f // cpu24.GROUP) * cpu24.GROUP
        assert w.nbytes_packed == padded * in_f // 2 + padded * in_f // 8 + out_f * 4  # codes, bits, scales
        assert w.nbytes_packed <= (5 + 32 / in_f) / 17 * fp32[i]  # 5 bits a weight and a scale a row, fp32 17


def test_bits_none_never_dequantizes_and_other_bits_are_refused():
    model = finalized()
    pack_weights(model, bits=8, measure=False)
    held = model[0].weight
    pack_weights(model, measure=False)
    assert model[0].weight is held and held.quantized
    with pytest.raises(ValueError, match=r"bits=16 is not supported; bits=8 holds the kept values as int8"):
        pack_weights(finalized(), bits=16)


def test_compiled_and_inference_mode_match_eager():
    model = finalized(torch.bfloat16)
    pack_weights(model, bits=8, measure=False)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, backend="nmsparse")(x)
    with torch.inference_mode():
        inference = model(x)
    assert torch.equal(eager, inference)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_deepcopy_pickling_shared_memory_and_casts_keep_int8():
    model = finalized()
    pack_weights(model, bits=8, measure=False)
    model.share_memory()
    assert all(model[i].weight.is_shared() and model[i].weight.scales.is_shared() for i in LAYERS)
    x = torch.randn(2, 64)
    with torch.no_grad():
        out = model(x)
        copied = copy.deepcopy(model)
        assert copied[0].weight.quantized and copied[0].weight.values.data_ptr() != model[0].weight.values.data_ptr()
        assert torch.equal(copied(x), out)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert loaded[0].weight.quantized and torch.equal(loaded(x), out)
        halved = copy.deepcopy(model).to(torch.bfloat16)
        w = halved[0].weight
        assert w.quantized and w.dtype == torch.bfloat16 and torch.equal(w.values, model[0].weight.values)
        torch.testing.assert_close(halved(x.bfloat16()).float(), out, rtol=3e-2, atol=3e-2)
    with pytest.raises(RuntimeError, match="cannot convert a packed 2:4 weight"):
        copy.deepcopy(model).double()


def test_writes_and_checkpoints_are_refused_by_name_and_unpacking_dequantizes():
    model = finalized()
    pack_weights(model, bits=8, measure=False)
    with pytest.raises(RuntimeError, match="would write into a packed 2:4 weight"), torch.no_grad():
        model[0].weight.add_(1)
    with pytest.raises(NotImplementedError, match=r"with int8 values: the packed state dict holds float values only"):
        pack_state_dict(model.state_dict())
    dequantized = {i: model[i].weight.dense() for i in LAYERS}
    scales = {i: model[i].weight.scales.clone() for i in LAYERS}
    assert unpack_weights(model) == ["0.weight", "2.weight"]
    for i in LAYERS:
        assert type(model[i].weight) is torch.nn.Parameter and torch.equal(model[i].weight.detach(), dequantized[i])
        assert torch.equal(records.get(model[i], records.INT8, "weight"), scales[i])  # for a save, or packing again


@pytest.mark.parametrize("tie", [True, False])
def test_a_hugging_face_llama_runs_2_4_int8_with_an_int8_head_and_tied_embedding(tie):
    transformers = pytest.importorskip("transformers")
    from models import magnitude_2_4, tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(transformers, tie=tie).to(torch.bfloat16)
    magnitude_2_4(model)
    ids = torch.randint(0, 256, (1, 12))
    head_before = model.lm_head.weight.detach().float().clone()
    decisions = pack_weights(model, bits=8, measure=False)
    head = model.lm_head.weight
    assert decisions["lm_head.weight"].reason.startswith("output head as dense int8 rows")
    assert isinstance(head, PackedLinearWeight) and head.dense_rows and head.quantized and head.dtype == torch.bfloat16
    assert (model.model.embed_tokens.weight is head) == tie  # one int8 table for a tied head and embedding
    # every row within half a step of its grid (then rounded to bf16)
    step = head.scales[:, None] / 2 + head_before.abs() * 2**-8
    assert bool(((head.dense().float() - head_before).abs() <= step * 1.0001).all())
    with torch.no_grad():
        logits = model(ids).logits
        # the same model with every packed weight replaced by its dequantized dense weight
        reference_model = copy.deepcopy(model)
        unpack_weights(reference_model)
        expected = reference_model(ids).logits
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(logits.float(), expected.float(), rtol=0.05, atol=0.05)
    assert out.shape == (1, 16)
    rows = head.values.numel() + head.scales.numel() * 4
    assert head.nbytes_packed == rows  # no position bits: int8 codes and a scale per row


def test_the_head_is_named_or_kept():
    model = finalized()
    decisions = pack_weights(model, bits=8, measure=False, head="3")
    assert model[3].weight.dense_rows and decisions["3.weight"].kernel == "cpu24"
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(model, x).float(), rtol=1e-4, atol=1e-4)
    kept = finalized()
    pack_weights(kept, bits=8, measure=False, head=None)
    assert type(kept[3].weight) is torch.nn.Parameter
    with pytest.raises(ValueError, match=r"head='1' names a GELU of this model; name an nn.Linear"):
        pack_weights(finalized(), bits=8, measure=False, head="1")


def test_an_int8_embedding_refuses_indices_out_of_range():
    transformers = pytest.importorskip("transformers")
    from models import magnitude_2_4, tiny_llama

    model = tiny_llama(transformers, tie=True)
    magnitude_2_4(model)
    pack_weights(model, bits=8, measure=False)
    with pytest.raises(IndexError, match="out of range for a table of 256 rows"):
        model.model.embed_tokens(torch.tensor([[3, 256]]))
