"""nmcompile.check on input it cannot fully check: the state dict found inside checkpoints, reports
that checked nothing are never ok, and unreadable files or dims are ValueErrors that say why."""

import pytest
import torch
from torch import nn

import nmcompile


def sparse(shape=(8, 16)):
    return nmcompile.masks.prune(torch.randn(shape), 2, 4, 1)


def test_check_finds_the_state_dict_nested_in_a_checkpoint(tmp_path):
    dense = torch.randn(8, 16)
    report = nmcompile.check({"model": {"fc.weight": dense}, "epoch": 3})
    assert set(report) == {"fc.weight"} and not report.ok and report.where == "['model']"
    with_optimizer = {"model": {"fc.weight": sparse()}, "optimizer": {"state": {0: {"exp_avg": dense}}}, "epoch": 3}
    report = nmcompile.check(with_optimizer)
    assert set(report) == {"fc.weight"} and report.ok  # the model's entry, not Adam's state
    torch.save({"wrapper": {"inner": {"fc.weight": dense}}}, tmp_path / "deep.pt")  # the only dict of tensors
    report = nmcompile.check(tmp_path / "deep.pt")
    assert not report.ok and report["fc.weight"].violations == 32 and "['wrapper']['inner']" in str(report)


def test_check_refuses_checkpoints_it_cannot_read_a_state_dict_from():
    with pytest.raises(ValueError, match=r"several dicts of tensors \(\['a'\], \['b'\]\)"):
        nmcompile.check({"a": {"w": sparse()}, "b": {"w": sparse()}})
    with pytest.raises(ValueError, match="holds no tensors"):
        nmcompile.check({"epoch": 3, "note": {"lr": 0.1}})


def test_a_report_that_checked_nothing_is_not_ok():
    report = nmcompile.check({"fc.bias": torch.zeros(8)})  # nothing 2-D
    assert len(report) == 0 and not report.ok and "no tensor was checked" in str(report)
    report = nmcompile.check({"fc.weight": torch.zeros(8, 6)})  # 6 is not divisible by 4: skipped with a reason
    assert not report.ok and "fc.weight" in report.skipped
    assert not nmcompile.check(nn.Linear(16, 8)).ok  # a model with no annotated or finalized weight


def test_check_dim_that_the_tensor_does_not_have_is_a_value_error():
    with pytest.raises(ValueError, match=r"dim=5 does not exist in 'fc.weight' of shape \(8, 16\)"):
        nmcompile.check({"fc.weight": sparse()}, dim=5)
    assert nmcompile.check({"fc.weight": sparse()}, dim=-1).ok


@pytest.mark.parametrize(
    "content, why",
    [(b"", "empty or ends early"), (b"not a checkpoint at all", "not a (readable torch.save file|file torch.load)")],
    ids=["empty", "garbage"],
)
def test_unreadable_state_dict_files_are_value_errors_naming_the_file(tmp_path, content, why):
    path = tmp_path / "weights.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=why) as info:
        nmcompile.check(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_whole_pickled_model_is_refused_with_the_fix(tmp_path):
    torch.save(nn.Linear(16, 8), tmp_path / "model.pt")
    with pytest.raises(ValueError, match=r"pickles a torch\.nn\.modules\.linear\.Linear object.*model\.state_dict\(\)"):
        nmcompile.check(tmp_path / "model.pt")


def test_empty_or_corrupt_onnx_is_a_value_error(tmp_path):
    pytest.importorskip("onnx")
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ValueError, match="not an ONNX model: it holds no graph"):
        nmcompile.check(tmp_path / "empty.onnx")
    (tmp_path / "corrupt.onnx").write_bytes(b"\x08\x07garbage\xff\xff\xff" * 20)
    with pytest.raises(ValueError, match="not a readable ONNX model"):
        nmcompile.check(tmp_path / "corrupt.onnx")
