"""finalize for one-shot recipes: bad calibration named, sequential calibration, fine-tuning after.

Each bad input is a named error (nothing changed) or a named fallback in ``report.fallbacks`` and a
warning, never a silent dense or NaN weight.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile
from nmcompile import masks
from nmcompile.oneshot.solve import NoCalibration, blocks

import reference as ref
from models import AOT

pytestmark = pytest.mark.filterwarnings("ignore:nmsparse. recipe state for")


class Net(nn.Module):
    def __init__(self, eager_fc2=False):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        self.eager_fc2 = eager_fc2

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = torch.compiler.disable(self.fc2)(h) if self.eager_fc2 else self.fc2(h)
        return self.fc3(F.relu(h))


def calibrated(recipe="wanda:2:4", batches=None, model=None):
    model = (model or Net()).eval()
    nmcompile.annotate(model, recipe)
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    with torch.no_grad():
        for x in batches if batches is not None else [torch.randn(40, 16)]:
            compiled(x)
    return model


def weights(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("how", ["never run", "run eagerly"])
def test_no_calibration_is_a_named_error_and_changes_nothing(how):
    model = Net().eval()
    nmcompile.annotate(model, "sparsegpt:2:4")
    if how == "run eagerly":
        with torch.no_grad():
            model(torch.randn(4, 16))  # not through the graph: nothing is gathered
    before = weights(model)
    with pytest.raises(NoCalibration, match="no calibration batch reached the 3 weights declared with sparsegpt:2:4"):
        nmcompile.finalize(model)
    assert all(torch.equal(before[k], v) for k, v in weights(model).items())
    assert nmcompile.effective_weights(model).keys() == {"fc1.weight", "fc2.weight", "fc3.weight"}  # still declared


def test_check_says_an_unsolved_one_shot_weight_needs_finalize():
    model = calibrated("sparsegpt:2:4")
    report = nmcompile.check(model)
    assert not report.ok
    for name in ("fc1.weight", "fc2.weight", "fc3.weight"):
        assert "not solved yet" in report[name].problem and "nmcompile.finalize(model)" in report[name].problem
    nmcompile.finalize(model)
    assert nmcompile.check(model).ok  # solved: deployed 2:4, no problem left


def test_a_weight_outside_the_graph_is_pruned_by_magnitude_and_named():
    model = calibrated(model=Net(eager_fc2=True))
    assert int(model.fc1.weight_nm_count) == 40 and int(model.fc2.weight_nm_count) == 0
    before = weights(model)
    with pytest.warns(UserWarning, match="fc2.weight: no calibration token reached it"):
        report = nmcompile.finalize(model)
    assert list(report.fallbacks) == ["fc2.weight"]
    assert "pruned by magnitude" in report.fallbacks["fc2.weight"][0]
    assert "fc2.weight: no calibration token" in str(report)
    assert torch.equal(model.fc2.weight.detach(), masks.prune(before["fc2.weight"], 2, 4, 1))
    assert nmcompile.check(model).ok


def test_non_finite_activations_are_a_named_error():
    x = torch.randn(8, 16)
    x[3, 2] = float("nan")
    model = calibrated(batches=[torch.randn(8, 16), x])
    before = weights(model)
    with pytest.raises(ValueError, match=r"fc1.weight \(wanda:2:4\): its calibration statistics are not finite"):
        nmcompile.finalize(model)
    assert all(torch.equal(before[k], v) for k, v in weights(model).items())
    nmcompile.oneshot.solve.reset(model)  # the fix the message gives
    assert int(model.fc1.weight_nm_count) == 0


def test_a_singular_hessian_falls_back_to_wanda_by_name():
    layer = nn.Linear(8, 4)
    x = torch.full((3, 8), 0.5) * torch.tensor([1.0, 2.0, 3.0]).unsqueeze(1)  # rank 1: every column the same
    model = calibrated("sparsegpt:2:4,percdamp=0", batches=[x], model=nn.Sequential(layer))
    w = layer.weight.detach().clone()
    with pytest.warns(UserWarning, match="not positive definite"):
        report = nmcompile.finalize(model)
    notes = report.fallbacks["0.weight"]
    assert any("3 calibration tokens for 8 input columns" in n for n in notes)
    assert any("pruned by Wanda's score" in n and "percdamp=0.1" in n for n in notes)
    torch.testing.assert_close(layer.weight.detach(), ref.wanda(w, x, 2, 4))


def test_fewer_tokens_than_columns_is_named_and_solved_with_dampening():
    x = torch.randn(5, 16)
    model = calibrated("sparsegpt:2:4", batches=[x])
    w = model.fc1.weight.detach().clone()
    with pytest.warns(UserWarning, match="5 calibration tokens for 16 input columns"):
        report = nmcompile.finalize(model)
    assert set(report.fallbacks) == {"fc1.weight", "fc2.weight", "fc3.weight"}
    torch.testing.assert_close(model.fc1.weight.detach(), ref.sparsegpt(w, x, 2, 4)[0], rtol=1e-4, atol=1e-4)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_finalize_options_are_checked():
    model = calibrated()
    with pytest.raises(ValueError, match="sequential=True\\) calibrates again before each block: pass calibration=batches"):
        nmcompile.finalize(model, sequential=True)
    with pytest.raises(TypeError, match="takes a list of calibration batches or a function of no arguments"):
        nmcompile.finalize(model, calibration=3)
    plain = Net()
    nmcompile.annotate(plain, "ste:2:4")
    with pytest.raises(ValueError, match="calibration=...\\) is for one-shot recipes"):
        nmcompile.finalize(plain, calibration=lambda: None)


# ---------------------------------------------------------------------------------------------
# sequential calibration
# ---------------------------------------------------------------------------------------------


class Stack(nn.Module):
    def __init__(self, depth=3, width=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_blocks_group_weights_by_numbered_module():
    names = ["emb.weight", "layers.0.q.weight", "layers.0.k.weight", "layers.1.q.weight", "head.weight",
             "h.10.mlp.weight"]
    assert blocks(names) == [["emb.weight"], ["layers.0.q.weight", "layers.0.k.weight"], ["layers.1.q.weight"],
                             ["head.weight"], ["h.10.mlp.weight"]]


@pytest.mark.parametrize("recipe", ["sparsegpt:2:4,blocksize=8", "wanda:2:4"])
def test_sequential_calibrates_each_block_on_the_pruned_blocks_before_it(recipe):
    model = Stack().eval()
    dense = [layer.weight.detach().clone() for layer in model.layers]
    nmcompile.annotate(model, recipe)
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    batches = [torch.randn(30, 16) for _ in range(2)]
    calls = []

    def calibration():
        with torch.no_grad():
            for x in batches:
                compiled(x)
        calls.append([int(layer.weight_nm_count) for layer in model.layers])

    report = nmcompile.finalize(model, calibration=calibration, sequential=True)
    # each pass gathers one block's statistics; the others are paused (count -1)
    assert calls == [[60, -1, -1], [-1, 60, -1], [-1, -1, 60]] and not report.fallbacks
    # the reference: layer k solved on the outputs of layers 0..k-1 already pruned
    x = torch.cat(batches)
    for k, layer in enumerate(model.layers):
        want = ref.sparsegpt(dense[k], x, 2, 4)[0] if recipe.startswith("sparsegpt") else ref.wanda(dense[k], x, 2, 4)
        torch.testing.assert_close(layer.weight.detach(), want, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            x = torch.tanh(F.linear(x, want, layer.bias))
    assert nmcompile.check(model).ok
    # one pass calibrates every layer on the dense model's activations: another result
    one_pass = Stack().eval()
    with torch.no_grad():
        for k, (a, b) in enumerate(zip(one_pass.layers, model.layers)):
            a.weight.copy_(dense[k])
            a.bias.copy_(b.bias)
    nmcompile.annotate(one_pass, recipe)
    compiled = torch.compile(one_pass, backend="nmsparse", options=AOT)
    nmcompile.finalize(one_pass, calibration=lambda: [compiled(x) for x in batches])
    assert torch.equal(one_pass.layers[0].weight, model.layers[0].weight)
    assert not torch.allclose(one_pass.layers[2].weight, model.layers[2].weight)


def test_a_failing_sequential_calibration_leaves_no_count_paused():
    model = Stack().eval()
    nmcompile.annotate(model, "wanda:2:4")

    def calibration():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        nmcompile.finalize(model, calibration=calibration, sequential=True)
    assert [int(layer.weight_nm_count) for layer in model.layers] == [0, 0, 0]


@pytest.mark.parametrize("taken", ["deepcopy", "torch.save(model)", "state_dict"])
def test_a_copy_taken_during_a_sequential_pass_calibrates_every_weight_later(taken):
    model = Stack().eval()
    nmcompile.annotate(model, "wanda:2:4")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    batches = [torch.randn(30, 16) for _ in range(2)]
    snapshot = {}

    def calibration():
        with torch.no_grad():
            for x in batches:
                compiled(x)
        if not snapshot and int(model.layers[1].weight_nm_count) < 0:  # a checkpoint callback mid-pass
            if taken == "deepcopy":
                snapshot["model"] = copy.deepcopy(model)
            elif taken == "torch.save(model)":
                buf = io.BytesIO()
                torch.save(model, buf)
                snapshot["model"] = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
            else:
                snapshot["state"] = {k: v.clone() for k, v in model.state_dict().items()}

    nmcompile.finalize(model, calibration=calibration, sequential=True)
    if taken == "state_dict":
        assert int(snapshot["state"]["layers.2.weight_nm_count"]) == -1  # the pause, as saved
        copied = Stack().eval()
        nmcompile.annotate(copied, "wanda:2:4")
        copied.load_state_dict(snapshot["state"])
    else:
        copied = snapshot["model"]
    assert nmcompile.check(copied).skipped == {} and "paused" not in str(nmcompile.check(copied))
    torch._dynamo.reset()
    again = torch.compile(copied, backend="nmsparse", options=AOT)
    with torch.no_grad():
        for x in batches:
            again(x)
    assert all(int(layer.weight_nm_count) > 0 for layer in copied.layers)  # every weight gathered
    nmcompile.finalize(copied)
    assert nmcompile.check(copied).ok


def test_a_negative_count_is_named_as_a_pause_with_the_fix():
    model = Stack().eval()
    nmcompile.annotate(model, "wanda:2:4")
    with torch.no_grad():
        model.layers[1].weight_nm_count.fill_(-1)
    text = str(nmcompile.check(model))
    assert "layers.1.weight" in text and "are paused" in text and "nmcompile.oneshot.solve.reset(model)" in text
    assert "AveragedModel" not in text


def test_a_one_shot_model_fine_tunes_with_asp_keeping_its_zeros():
    model = calibrated("sparsegpt:2:4")
    nmcompile.finalize(model)
    zeros = {k: v == 0 for k, v in weights(model).items() if k.endswith("weight")}
    nmcompile.annotate(model, "asp:2:4,permute=0")
    torch._dynamo.reset()
    compiled = torch.compile(model.train(), backend="nmsparse", options=AOT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = compiled(torch.randn(8, 16)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    effective = nmcompile.effective_weights(model)
    for name, was_zero in zeros.items():
        assert bool((effective[name][was_zero] == 0).all()), name
    assert set(nmcompile.finalize(model)) == set(zeros)


def _calibrate_on_rank(rank, directory):
    import os

    torch.manual_seed(0)
    model = Net().eval()  # the same weights on every rank
    nmcompile.annotate(model, "sparsegpt:2:4,blocksize=8")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(100 + rank))  # each rank its own share
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nmcompile.finalize(model, calibration=lambda: compiled(x))
    torch.save({k: v.detach() for k, v in model.named_parameters()}, os.path.join(directory, f"rank{rank}.pt"))


@pytest.mark.slow
def test_ranks_sum_their_statistics_and_get_the_same_weights(tmp_path):
    from _distributed import WORLD, run_ranks

    run_ranks(_calibrate_on_rank, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    torch.manual_seed(0)
    dense = Net()
    x = torch.cat([torch.randn(40, 16, generator=torch.Generator().manual_seed(100 + r)) for r in range(WORLD)])
    want = ref.sparsegpt(dense.fc1.weight.detach(), x, 2, 4)[0]
    for r in range(WORLD):
        torch.testing.assert_close(got[r]["fc1.weight"], want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got[r]["fc3.weight"], got[0]["fc3.weight"])


@pytest.mark.slow
def test_a_one_shot_model_deploys_like_any_finalized_model(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = calibrated("sparsegpt:2:4")
    nmcompile.finalize(model)
    x = torch.randn(4, 16)
    exported = nmcompile.export_onnx(model, (x,), tmp_path / "oneshot.onnx")
    assert exported.check.ok and len(exported.initializers) == 3 and exported.max_abs_diff < 1e-4
    torch._dynamo.reset()
    with torch.no_grad():
        deployed = torch.compile(model, backend="nmsparse", options={**AOT, "deploy_kernel": "reference"})(x)
    torch.testing.assert_close(deployed, model(x))
    packed = nmcompile.pack(model.fc1.weight.detach())
    assert torch.equal(nmcompile.unpack(packed), model.fc1.weight.detach())


def test_statistics_are_undefined_until_their_first_rows_and_zeroed_then():
    from nmcompile.masks.calibration import accumulate

    x = torch.randn(6, 8)
    stat, count = torch.full((8, 8), float("nan")), torch.zeros((), dtype=torch.int64)
    accumulate(stat, count, x, None, -1, True)  # uninitialised (or released) memory: overwritten
    torch.testing.assert_close(stat, x.T @ x)
    accumulate(stat, count, x, None, -1, True)
    torch.testing.assert_close(stat, 2 * x.T @ x)
    stacked, counts = torch.full((3, 8), float("nan")), torch.tensor([0, 4, 0])
    stacked[1] = 1.0
    accumulate(stacked, counts, x, None, 2, False)  # expert 2's first rows; expert 1 keeps its sums
    torch.testing.assert_close(stacked, torch.stack([torch.zeros(8), torch.ones(8), x.square().sum(0)]))
    paused, before = torch.full((8, 8), 7.0), torch.tensor(-1)
    accumulate(paused, before, x, None, -1, True)
    assert paused._version == 0 and int(before) == -1  # paused: not touched


def test_release_gives_memory_back_and_keeps_the_tensor():
    from pathlib import Path

    from nmcompile.oneshot.solve import release

    def resident_mb():
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

    stat = torch.ones(4096, 4096)  # 64 MB, written
    held, before = stat, resident_mb()
    release(stat)
    assert before - resident_mb() > 48  # the pages went back
    assert held is stat and stat.shape == (4096, 4096) and stat.stride() == (4096, 1)
    stat.zero_()  # usable again, as the next calibration rows do
    assert float(stat.sum()) == 0


@pytest.mark.inductor
@pytest.mark.slow
def test_sequential_under_inductor_touches_one_block_of_statistics_at_a_time():
    # why memory does not grow with depth: the Inductor graph updates the active block's statistics in place
    # and leaves the paused ones alone (aot_eager copies every mutated buffer back at each call)
    model = Stack(depth=4, width=32).eval()
    dense = [layer.weight.detach().clone() for layer in model.layers]
    nmcompile.annotate(model, "sparsegpt:2:4,blocksize=8")
    compiled = torch.compile(model, backend="nmsparse")
    batches = [torch.randn(64, 32) for _ in range(2)]
    layers, active = list(model.layers), []

    def calibration():
        # the paused statistics get no memory at all for this pass: any read or write of them would fail
        paused = [layer.weight_nm_xtx.untyped_storage() for layer in layers if int(layer.weight_nm_count) < 0]
        active.append([k for k, layer in enumerate(layers) if int(layer.weight_nm_count) == 0])
        sizes = [storage.nbytes() for storage in paused]
        for storage in paused:
            storage.resize_(0)
        try:
            with torch.no_grad():
                for x in batches:
                    compiled(x)
        finally:
            for storage, size in zip(paused, sizes):
                storage.resize_(size)

    nmcompile.finalize(model, calibration=calibration, sequential=True)
    # the first call runs eagerly, up to the end of the model's first forward: the order the blocks run in
    assert active == [[0, 1, 2, 3], [0], [1], [2], [3]]
    x = torch.cat(batches)
    for k, layer in enumerate(model.layers):  # each block solved on the pruned blocks' outputs, as before
        want = ref.sparsegpt(dense[k], x, 2, 4)[0]
        torch.testing.assert_close(layer.weight.detach(), want, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            x = torch.tanh(F.linear(x, want, layer.bias))
