"""``activations="int8"``: a model's int8 weights (2:4 and the head's dense rows) run on the route that quantizes
each call's activations in blocks of 32 and multiplies integers; declared on ``pack_weights`` or
``load_pretrained``, switched back and forth on a packed model, refused by name where it cannot apply."""

import copy

import pytest
import torch

from nmcompile.deploy import PackedLinearWeight, load_pretrained, pack_weights, save_pretrained, unpack_weights
from nmcompile.kernels import cpu24
from models import magnitude_2_4, packed_test_model, tiny_llama

pytestmark = pytest.mark.skipif("avx2" not in cpu24.isas(), reason="the int8-activation route needs AVX2")

A8 = cpu24.A8_ISA


def int8_weights(model):
    return {name: p for name, p in model.named_parameters() if isinstance(p, PackedLinearWeight) and p.quantized}


def llama(dtype=torch.bfloat16):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_llama(transformers, tie=True).to(dtype).eval()
    magnitude_2_4(model)
    return model


IDS = torch.tensor([[1, 5, 9, 77, 3, 120, 4, 8]])


def test_every_int8_weight_and_the_tied_head_take_the_route_and_switch_back_exactly():
    model = llama()
    with torch.no_grad():
        float_route = copy.deepcopy(model)
        pack_weights(float_route, bits=8, measure=False)
        expected = float_route(IDS).logits.float()
        decisions = pack_weights(model, bits=8, measure=False, activations="int8")
        held = int8_weights(model)
        assert model.lm_head.weight.dense_rows and model.lm_head.weight.isa == A8
        assert model.model.embed_tokens.weight is model.lm_head.weight  # still one int8 table
        assert all(p.isa == A8 for p in held.values()) and all(d.isa == A8 for d in decisions.values())
        # the same codes as the float route's: only the activations' rounding differs
        for name, p in int8_weights(float_route).items():
            assert torch.equal(p.values, held[name].values) and torch.equal(p.scales, held[name].scales)
        a8 = model(IDS).logits.float()
        error = float((a8 - expected).norm() / expected.norm())
        assert 1e-4 < error < 0.03, error
        # traced through the packed weights (their route is part of what a graph is compiled for); Inductor's
        # fusions of the bf16 layers around them would add their own rounding
        compiled = torch.compile(model, backend="aot_eager")(IDS).logits.float()
        torch.testing.assert_close(compiled, a8, rtol=0, atol=0)
        out = model.generate(IDS, max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 11)
        pack_weights(model, measure=False)  # bits=None, activations="float": back on the float route
        assert all(p.isa == cpu24.best_isa(torch.int8) for p in int8_weights(model).values())
        assert torch.equal(model(IDS).logits.float(), expected)


def test_int8_activations_without_int8_weights_or_with_another_value_are_refused():
    with pytest.raises(ValueError, match=r"activations='int8' is the route of int8 weights.*pass bits=8"):
        pack_weights(packed_test_model(), measure=False, activations="int8")
    with pytest.raises(ValueError, match=r"activations='fp8': int8 weights take their activations as 'float'"):
        pack_weights(packed_test_model(), bits=8, measure=False, activations="fp8")


def test_an_int8_directory_loads_on_the_route_and_a_float_one_refuses_it(tmp_path):
    model = llama(torch.float32)
    pack_weights(model, bits=8, measure=False)
    unpack_weights(model)
    save_pretrained(model, tmp_path / "int8")
    loaded = load_pretrained(tmp_path / "int8", packed=True, measure=False, activations="int8")
    held = int8_weights(loaded)
    assert held and all(p.isa == A8 for p in held.values()) and loaded.lm_head.weight.dense_rows
    with torch.no_grad():
        pack_weights(model, bits=8, measure=False, activations="int8")
        torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"activations='int8' is the route of int8 weights held packed.*loaded dense"):
        load_pretrained(tmp_path / "int8", activations="int8")
    plain = llama()
    save_pretrained(plain, tmp_path / "float")
    with pytest.raises(ValueError, match=r"hold float values. Drop activations="):
        load_pretrained(tmp_path / "float", packed=True, measure=False, activations="int8")
