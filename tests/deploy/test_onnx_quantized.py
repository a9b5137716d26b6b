"""``export_onnx`` of a model whose 2:4 weights lie on int8 or 4-bit grids: int8 initializers with a per-channel
``DequantizeLinear`` in front of their consumers (the Q/DQ form), INT4 ones with a blocked one (opset 21), or
int8 storage of 4-bit codes in older opsets; onnxruntime against PyTorch, and ``check_onnx`` checking the codes."""

import json

import pytest
import torch

from nmcompile.deploy import export_onnx, pack_weights, unpack_weights
from nmcompile.deploy.onnx import METADATA_KEY, check_onnx
from nmcompile.kernels import cpu24
from models import magnitude_2_4, tiny_llama

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel: {cpu24.status().reason}")
from onnx import numpy_helper  # noqa: E402


def _on_grids(model, bits=8):
    """``model`` (finalized 2:4) with its 2:4 weights on int8 or 4-bit grids, recorded: packed, then unpacked."""
    if bits == 4 and "avx2" not in cpu24.isas():
        pytest.skip("4-bit values are packed on the AVX2 kernel")
    pack_weights(model, bits=bits, measure=False, head=None)
    unpack_weights(model)
    return model.eval()


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    magnitude_2_4(model)
    return _on_grids(model)


def test_int8_initializers_are_dequantized_per_channel_and_run_as_pytorch_does(tmp_path):
    model = _mlp()
    x = torch.randn(5, 64)
    report = export_onnx(model, (x,), tmp_path / "m.onnx")
    assert report.max_abs_diff is not None and report.max_abs_diff < 1e-4
    proto = onnx.load(tmp_path / "m.onnx")
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    for i, (out_f, in_f) in ((0, (96, 64)), (2, (32, 96))):
        codes, scales = inits[f"{i}.weight_int8"], inits[f"{i}.weight_scale"]
        assert f"{i}.weight" not in inits and codes.dtype.name == "int8" and codes.shape == (out_f, in_f)
        assert scales.dtype.name == "float32" and scales.shape == (out_f,)
        weight = model[i].weight.detach()
        assert torch.equal(torch.tensor(codes).float() * torch.tensor(scales)[:, None], weight)
    dq = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    assert sorted(n.output[0] for n in dq) == ["0.weight", "2.weight"]
    assert all(onnx.helper.get_attribute_value(a) == 0 for n in dq for a in n.attribute if a.name == "axis")
    record = json.loads({p.key: p.value for p in proto.metadata_props}[METADATA_KEY])
    assert record["0.weight_int8"] == {"pattern": "2:4", "axis": 1, "parameter": "0.weight", "recipe": "", "bits": 8,
                                       "scale": "0.weight_scale"}
    checked = check_onnx(tmp_path / "m.onnx")
    assert checked.ok and set(checked) == {"0.weight", "2.weight"}


@pytest.mark.parametrize("bits, opset", [(8, None), (4, None), (4, 20)])
def test_check_onnx_names_codes_that_are_not_2_4_or_lack_their_scale(tmp_path, bits, opset):
    model = _mlp() if bits == 8 else _mlp4()
    export_onnx(model, (torch.randn(2, model[0].in_features),), tmp_path / "m.onnx", verify=False, opset=opset)
    proto = onnx.load(tmp_path / "m.onnx")
    for init in proto.graph.initializer:
        if init.name == f"0.weight_int{bits}":
            codes = numpy_helper.to_array(init).copy()
            codes.reshape(model[0].out_features, -1)[0, :4] = 5  # a group of 4 that keeps all four
            init.CopyFrom(numpy_helper.from_array(codes, init.name))
    scale = next(i for i in proto.graph.initializer if i.name == "2.weight_scale")
    proto.graph.initializer.remove(scale)
    onnx.save(proto, tmp_path / "bad.onnx")
    report = check_onnx(tmp_path / "bad.onnx")
    assert not report.ok and report["0.weight"].violations == 1
    assert "scale initializer '2.weight_scale' is missing" in report["2.weight"].problem


@pytest.mark.parametrize("bits", [8, 4])
def test_a_weight_off_its_grid_is_refused_by_name(tmp_path, bits):
    model = _mlp() if bits == 8 else _mlp4()
    with torch.no_grad():
        model[2].weight.mul_(1.37)
    grid = "int8" if bits == 8 else "4-bit"
    with pytest.raises(ValueError, match=rf"values of 2.weight are not on the {grid} grid recorded for it"):
        export_onnx(model, (torch.randn(2, model[0].in_features),), tmp_path / "m.onnx", verify=False)


def _mlp4():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    magnitude_2_4(model)
    return _on_grids(model, 4)


@pytest.mark.parametrize("opset", [None, 20])
def test_4_bit_initializers_are_dequantized_in_blocks_and_run_as_pytorch_does(tmp_path, opset):
    """Opset 21 (asked for by default): INT4 codes and a DequantizeLinear with block_size; opset 20, whose
    DequantizeLinear has no blocks: the codes stored as int8 [out, blocks, group], Cast, Mul, Reshape."""
    model = _mlp4()
    x = torch.randn(5, 128)
    report = export_onnx(model, (x,), tmp_path / "m.onnx", opset=opset)
    assert report.max_abs_diff is not None and report.max_abs_diff < 1e-4
    proto = onnx.load(tmp_path / "m.onnx")
    assert next(o.version for o in proto.opset_import if o.domain == "") == (opset or 21)
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    for i, (out_f, in_f) in ((0, (64, 128)), (2, (32, 64))):
        codes, scales = inits[f"{i}.weight_int4"], inits[f"{i}.weight_scale"]
        assert f"{i}.weight" not in inits
        if opset is None:
            assert codes.dtype.name == "int4" and codes.shape == (out_f, in_f) and scales.shape == (out_f, in_f // 64)
        else:
            assert codes.dtype.name == "int8" and codes.shape == (out_f, in_f // 64, 64)
            assert scales.shape == (out_f, in_f // 64, 1)
        codes = torch.tensor(codes.astype("float32")).reshape(out_f, in_f)
        spread = torch.tensor(scales).reshape(out_f, -1).repeat_interleave(64, dim=1)
        assert codes.abs().max() <= 8 and torch.equal(codes * spread, model[i].weight.detach())
    dq = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    if opset is None:
        assert sorted(n.output[0] for n in dq) == ["0.weight", "2.weight"]
        attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in dq]
        assert all(a == {"axis": 1, "block_size": 64} for a in attrs)
    else:
        assert not dq and sum(n.op_type == "Reshape" and n.output[0] in ("0.weight", "2.weight") for n in proto.graph.node) == 2
    record = json.loads({p.key: p.value for p in proto.metadata_props}[METADATA_KEY])
    assert record["0.weight_int4"] == {"pattern": "2:4", "axis": 1, "parameter": "0.weight", "recipe": "", "bits": 4,
                                       "scale": "0.weight_scale", "group": 64}
    checked = check_onnx(tmp_path / "m.onnx")
    assert checked.ok and set(checked) == {"0.weight", "2.weight"}


@pytest.mark.parametrize("bits", [8, 4])
def test_a_hugging_face_llama_exports_its_transposed_quantized_weights(tmp_path, bits):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_llama(transformers)
    magnitude_2_4(model)
    _on_grids(model, bits)
    ids = torch.tensor([[1, 5, 9, 77, 3, 120, 4, 8]])

    class Logits(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids).logits

    report = export_onnx(Logits(model), (ids,), tmp_path / "llama.onnx", dynamic_batch=False)
    assert report.max_abs_diff < 1e-3
    proto = onnx.load(tmp_path / "llama.onnx")
    dq = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 14  # every 2:4 linear of the two blocks; the head stays float
    checked = check_onnx(tmp_path / "llama.onnx")
    assert checked.ok and len(checked) == 14
