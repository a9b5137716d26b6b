"""ONNX export of finalized models: zero-filled N:M initializers, recorded, verified, run by onnxruntime."""

import json

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile.deploy.onnx import METADATA_KEY
from nmcompile.app.cli import main as cli
from models import CNN, encoder_layer

onnx = pytest.importorskip("onnx", reason="pip install 'nmcompile[onnx]'")
pytest.importorskip("onnxruntime", reason="pip install 'nmcompile[onnx]'")
pytest.importorskip("onnxscript", reason="pip install 'nmcompile[onnx]'")


def finalized(model, spec="sr_ste:2:4", **kw):
    nmcompile.annotate(model, spec, **kw)
    nmcompile.finalize(model)
    return model.eval()


def recorded(path):
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    return json.loads(props[METADATA_KEY])


def test_mlp_exports_with_dynamic_batch_and_matches_onnxruntime(tmp_path):
    import onnxruntime as ort

    model = finalized(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    path = tmp_path / "mlp.onnx"
    report = nmcompile.export_onnx(model, torch.randn(4, 32), path)
    assert report.check.ok and set(report.check) == {"0.weight", "2.weight"}
    assert report.max_abs_diff is not None and report.max_abs_diff < 1e-5
    entries = recorded(path)
    assert entries["0.weight"] == {"pattern": "2:4", "axis": 1, "parameter": "0.weight", "recipe": "sr_ste:2:4"}
    # the initializers are the dense, zero-filled finalized weights
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    assert (torch.from_numpy(inits["0.weight"].copy()) == model[0].weight.detach()).all()
    # dynamic batch: another batch size runs
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(9, 32)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), model(x), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_cnn_and_transformer_layer_export(tmp_path):
    cnn = finalized(CNN())
    report = nmcompile.export_onnx(cnn, torch.randn(2, 3, 8, 8), tmp_path / "cnn.onnx")
    assert report.check.ok and {"conv2.weight", "conv3.weight"} <= set(recorded(tmp_path / "cnn.onnx"))
    layer = finalized(encoder_layer())
    report = nmcompile.export_onnx(layer, torch.randn(2, 6, 32), tmp_path / "enc.onnx")
    entries = recorded(tmp_path / "enc.onnx")
    assert {e["parameter"] for e in entries.values()} == {
        "self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight"
    }
    assert report.check.ok and len(report.check) == 4
    assert report.max_abs_diff < 1e-4


def test_check_reports_a_tampered_file_and_the_cli_exit_status(tmp_path, capsys):
    model = finalized(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    path = tmp_path / "m.onnx"
    nmcompile.export_onnx(model, torch.randn(4, 32), path)
    assert cli(["check", str(path)]) == 0
    assert "2/2 tensors comply" in capsys.readouterr().out
    proto = onnx.load(str(path))
    init = next(i for i in proto.graph.initializer if i.name == "2.weight")
    dense = onnx.numpy_helper.from_array(torch.randn(16, 64).numpy(), "2.weight")
    init.CopyFrom(dense)
    onnx.save(proto, str(path))
    report = nmcompile.check(path)
    assert not report.ok and not report["2.weight"].ok and report["0.weight"].ok
    assert cli(["check", str(path)]) == 1
    assert "2.weight: 2:4 along dim 1: 256/256 groups violate" in capsys.readouterr().out
    assert cli(["check", str(tmp_path / "missing.onnx")]) == 2


def test_bad_input_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="no weight of Sequential is finalized"):
        nmcompile.export_onnx(nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8), tmp_path / "a.onnx")
    model = nn.Sequential(nn.Linear(8, 8))
    nmcompile.annotate(model, "ste:2:4")
    with pytest.raises(ValueError, match="annotated but not finalized.*nmcompile.finalize"):
        nmcompile.export_onnx(model, torch.randn(2, 8), tmp_path / "b.onnx")
    assert not (tmp_path / "b.onnx").exists()


@pytest.mark.slow
def test_half_precision_exports_and_bfloat16_says_why_it_cannot_be_compared(tmp_path):
    model = finalized(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    report = nmcompile.export_onnx(model.half(), torch.randn(4, 32, dtype=torch.float16), tmp_path / "h.onnx")
    assert report.check.ok and report.max_abs_diff < 1e-2
    path = tmp_path / "b.onnx"
    with pytest.raises(RuntimeError, match="verified, but onnxruntime's CPU provider could not run it.*verify=False"):
        nmcompile.export_onnx(model.bfloat16(), torch.randn(4, 32, dtype=torch.bfloat16), path)
    assert nmcompile.check(path).ok  # the file itself is fine
    assert nmcompile.export_onnx(model, torch.randn(4, 32, dtype=torch.bfloat16), path, verify=False).max_abs_diff is None


def test_a_damaged_nmcompile_record_is_named_and_exits_2(tmp_path, capsys):
    model = finalized(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    path = tmp_path / "m.onnx"
    nmcompile.export_onnx(model, torch.randn(4, 32), path)
    proto = onnx.load(str(path))
    good = proto.metadata_props[0].value
    for damaged, what in (
        (good[: len(good) // 2], "not valid JSON"),
        ("[1, 2]", "expected a JSON object of initializers, got list"),
        (good.replace('"2:4"', '"two of four"', 1), "damaged at initializer '0.weight'"),
    ):
        proto.metadata_props[0].value = damaged
        onnx.save(proto, str(path))
        assert cli(["check", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"nmcompile check: {path}: nmcompile's record") and what in err, err
        assert METADATA_KEY in err and "export the model again with nmcompile.export_onnx" in err
        assert err.count("\n") == 1


def test_export_keeps_the_exporters_noise_to_itself(tmp_path, capfd, caplog):
    import logging
    import warnings

    model = finalized(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    filters = list(registration.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nmcompile.export_onnx(model, torch.randn(4, 32), tmp_path / "m.onnx")
        warnings.warn("after the export", FutureWarning)  # the user's own filters are back
    err = capfd.readouterr().err
    assert "torchvision is not installed" not in err and "torchvision" not in caplog.text
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == ["after the export"]
    assert registration.filters == filters  # the logging filter was scoped to the export


def test_check_names_recorded_initializers_by_their_parameter(tmp_path, capsys):
    from onnx import TensorProto, helper, numpy_helper

    weight = nmcompile.masks.prune(torch.randn(8, 16), 2, 4, 1)
    nodes = [helper.make_node("MatMul", ["x", "val_8"], ["h"]), helper.make_node("MatMul", ["h", "val_9"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(weight.numpy(), "val_8"), numpy_helper.from_array(torch.randn(16, 4).numpy(), "val_9")],
    )
    model = helper.make_model(graph)
    model.metadata_props.add(key=METADATA_KEY, value=json.dumps(
        {"val_8": {"pattern": "2:4", "axis": 1, "parameter": "blocks.0.mlp.fc.weight", "recipe": "ste:2:4"}}))
    path = tmp_path / "named.onnx"
    onnx.save(model, str(path))
    report = nmcompile.check(path)
    assert report.ok and list(report) == ["blocks.0.mlp.fc.weight"] and list(report.skipped) == ["val_9"]
    assert list(nmcompile.check(path, only="blocks.*.fc.weight")) == ["blocks.0.mlp.fc.weight"]
    assert cli(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.mlp.fc.weight: 2:4 along dim 1: ok" in out and "val_8" not in out


def test_a_small_model_is_one_file_with_no_sidecar(tmp_path):
    model = finalized(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    nmcompile.export_onnx(model, torch.randn(4, 32), tmp_path / "one.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.onnx"]  # no .onnx.data that nothing reads
    proto = onnx.load(str(tmp_path / "one.onnx"), load_external_data=False)
    assert all(not init.external_data for init in proto.graph.initializer)
    report = nmcompile.export_onnx(model, torch.randn(4, 32), tmp_path / "two.onnx", external_data=True)
    assert report.check.ok and (tmp_path / "two.onnx.data").exists()  # asked for: written and referred to
    proto = onnx.load(str(tmp_path / "two.onnx"), load_external_data=False)
    assert {entry.value for init in proto.graph.initializer for entry in init.external_data if entry.key == "location"} == {"two.onnx.data"}
