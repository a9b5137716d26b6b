"""``pack_weights(bits=4)``: a model's 2:4 weights held as 4-bit codes with a scale per row and group of positions,
computed on the int8-activation route (``nmsparse::cpu24_linear_q4``); the head as dense int8 rows; refused by name
where it cannot apply."""

import copy

import pytest
import torch

import reference
from nmcompile.deploy import PackedLinearWeight, pack_weights, unpack_weights
from nmcompile.kernels import cpu24
from models import magnitude_2_4, tiny_llama

pytestmark = pytest.mark.skipif("avx2" not in cpu24.isas(), reason="4-bit values run on the AVX2 int8-activation route")

IDS = torch.tensor([[1, 5, 9, 77, 3, 120, 4, 8]])


def int4_weights(model):
    return {name: p for name, p in model.named_parameters() if isinstance(p, PackedLinearWeight) and p.int4}


def llama(dtype=torch.bfloat16):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_llama(transformers, hidden=128, intermediate=256, tie=True).to(dtype).eval()  # K: 128, 256
    magnitude_2_4(model)
    return model


@pytest.mark.parametrize("group", (64, 128))
def test_every_2_4_weight_holds_the_definitions_grid_and_the_model_runs_on_it(group):
    model = llama()
    dense = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        decisions = pack_weights(model, bits=4, group=group, measure=False)
        held = int4_weights(model)
        # every 2:4 linear (7 a layer, two layers) and the tied head (dense rows) at 4 bits, on the same route
        head = model.lm_head.weight
        assert head.dense_rows and head.int4 and head.isa == cpu24.A8_ISA and head.group == group
        assert model.model.embed_tokens.weight is head  # one 4-bit table
        codes, scales = reference.int4_groups(dense["model.embed_tokens.weight"].float(), group)
        assert torch.equal(head.dense(), (codes * scales.repeat_interleave(group, dim=1)).to(torch.bfloat16))
        assert head.nbytes_packed <= head.numel() * (4 + 16 / group) / 8 + 8 * head.shape[1]  # plus padding rows
        held.pop("model.embed_tokens.weight")  # the tied head's name
        assert len(held) == 14 and all(p.group == group and p.isa == cpu24.A8_ISA for p in held.values())
        assert all("4-bit values" in decisions[name].reason for name in held)
        for name, p in held.items():
            codes, scales = reference.int4_groups(dense[name].float(), group)
            expected = (codes * scales.repeat_interleave(group, dim=1)).to(torch.bfloat16)
            assert torch.equal(p.dense(), expected), name
            # 2 bits of value, 1 of position, 16 / group of scale a weight; bf16 holds 16
            assert p.nbytes_packed / (dense[name].numel() * 2) <= (3 + 16 / group) / 16 + 1e-9
        reference_model = copy.deepcopy(model)
        unpack_weights(reference_model)  # the dequantized weights, dense: float activations
        expected = reference_model(IDS).logits.float()
        got = model(IDS).logits.float()
        error = float((got - expected).norm() / expected.norm())
        assert 1e-4 < error < 0.03, error  # the activations' rounding to 8 bits, nothing more
        compiled = torch.compile(model, backend="aot_eager")(IDS).logits.float()
        torch.testing.assert_close(compiled, got, rtol=0, atol=0)
        assert model.generate(IDS, max_new_tokens=3, do_sample=False).shape == (1, 11)
        before = {name: p.values.clone() for name, p in held.items()}
        pack_weights(model, bits=4, group=group, measure=False)  # idempotent
        assert all(torch.equal(int4_weights(model)[name].values, v) for name, v in before.items())
        pack_weights(model, measure=False)  # bits=None keeps the 4-bit weights on their route
        assert all(p.int4 and p.isa == cpu24.A8_ISA for p in int4_weights(model).values())
        assert model.lm_head.weight.isa == cpu24.A8_ISA


def test_the_head_takes_int8_rows_on_request_and_its_embedding_looks_rows_up():
    model = llama()
    with torch.no_grad():
        expected = copy.deepcopy(model)
        pack_weights(model, bits=4, head_bits=8, measure=False)
        head = model.lm_head.weight
        assert head.dense_rows and not head.int4 and head.isa == cpu24.A8_ISA
        pack_weights(expected, bits=4, measure=False)
        ids = torch.tensor([[3, 0, 255, 17]])
        for m in (model, expected):  # the tied embedding: the rows of the table, dequantized
            table = m.lm_head.weight.dense()
            torch.testing.assert_close(m.model.embed_tokens(ids), table[ids], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"head_bits=4 with bits=8"):
        pack_weights(llama(), bits=8, head_bits=4, measure=False)
    with pytest.raises(ValueError, match=r"the output head lm_head holds 4-bit rows in groups of 64; head_bits=8"):
        pack_weights(expected, bits=4, head_bits=8, measure=False)


def test_a_layer_whose_width_is_not_a_multiple_of_the_group_keeps_float_values_and_says_so():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Linear(64, 32)).to(torch.bfloat16)
    magnitude_2_4(model)
    decisions = pack_weights(model, bits=4, group=64, measure=False)
    packed = {name: p for name, p in model.named_parameters() if isinstance(p, PackedLinearWeight)}
    narrow = [name for name, p in packed.items() if p.weight_shape[1] % 64]
    assert narrow and all(not packed[name].quantized for name in narrow)
    assert all("in_features" in decisions[name].reason and "group=64" in decisions[name].reason for name in narrow)
    assert all(p.int4 for name, p in packed.items() if name not in narrow)


def test_bits_4_is_refused_by_name_where_it_cannot_apply():
    with pytest.raises(ValueError, match=r"bits=4 runs with int8 activations only.*activations='float'"):
        pack_weights(llama(), bits=4, measure=False, activations="float")
    with pytest.raises(ValueError, match=r"group=32 is not supported.*64 or 128"):
        pack_weights(llama(), bits=4, group=32, measure=False)
    with pytest.raises(ValueError, match=r"bits=3 is not supported"):
        pack_weights(llama(), bits=3, measure=False)
    int8 = llama()
    pack_weights(int8, bits=8, measure=False)
    with pytest.raises(ValueError, match=r"holds int8 values; bits=4 rounds float values.*unpack_weights"):
        pack_weights(int8, bits=4, measure=False)
    int4 = llama()
    pack_weights(int4, bits=4, measure=False)
    with pytest.raises(ValueError, match=r"holds 4-bit values in groups of 64; bits=8"):
        pack_weights(int4, bits=8, measure=False)
    with pytest.raises(ValueError, match=r"holds 4-bit values in groups of 64; bits=4"):
        pack_weights(int4, bits=4, group=128, measure=False)
    with pytest.raises(ValueError, match=r"activations='float': this model holds 4-bit values"):
        pack_weights(int4, measure=False, activations="float")
    weight = next(iter(int4_weights(int4).values()))
    with pytest.raises(NotImplementedError, match="with 4-bit values: the packed state dict holds float values only"):
        weight.packed()
    assert "values=int4, group=64" in repr(weight)


def test_unpacked_4_bit_weights_pack_to_the_same_weights_in_fp32():
    model = llama(torch.float32)
    pack_weights(model, bits=4, measure=False)
    held = {name: (p.dense(), p.scales.clone()) for name, p in int4_weights(model).items()}
    unpack_weights(model)
    assert not int4_weights(model)
    pack_weights(model, bits=4, measure=False)
    # the same scales and weights (a kept value whose code is 0 may be kept at another zero's position)
    for name, p in int4_weights(model).items():
        assert torch.equal(p.dense(), held[name][0]) and torch.equal(p.scales, held[name][1]), name
