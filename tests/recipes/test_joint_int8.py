"""SparseGPT's joint sparsification and int8 quantization (``sparsegpt:2:4,bits=8``) and Wanda's round to
nearest (``wanda:2:4,bits=8``): the solver against the float64 reference written from the paper's equations
(tests/reference.py), the grid recorded by ``finalize`` and served by ``pack_weights`` without a second rounding."""

from __future__ import annotations

import pytest
import torch

import nmcompile
from nmcompile import masks
from nmcompile.kernels import cpu24
from nmcompile.kernels.cpu24.quantize import LEVELS, row_scales
from nmcompile.state import records

import reference as ref
from test_wanda_sparsegpt import calibration, nm_ok, weight


def on_grid(w, scales):
    steps = w.double() / scales.double()[:, None]
    return bool(((steps - steps.round()).abs() < 1e-3).all() and (steps.abs() <= LEVELS + 1e-3).all())


@pytest.mark.parametrize("n, m, blocksize", [(2, 4, 128), (2, 4, 8), (1, 4, 16)])
def test_the_joint_solve_matches_the_reference(n, m, blocksize):
    w, x = weight(12, 32), calibration(200, 32)
    scales = row_scales(w)
    got = masks.oneshot.sparsegpt(w, x.T @ x, x.shape[0], n, m, blocksize=blocksize, scales=scales)
    want, keep = ref.sparsegpt(w, x, n, m, scales=scales)
    assert torch.equal(got != 0, keep & (want != 0))  # a kept entry may round to zero
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert nm_ok(got, n, m) and on_grid(got, scales)


@pytest.mark.parametrize("coarse", [1, 8])
def test_the_joint_solve_reconstructs_better_than_rounding_after_the_solve(coarse):
    """Greedy, so not on every matrix: over eight, its reconstruction error is the smaller one in sum."""
    joint = rounded = 0.0
    for seed in range(8):
        w, x = weight(24, 64, seed), calibration(256, 64, seed + 10)
        scales = row_scales(w) * coarse  # coarse: fewer levels, so that rounding matters more

        def error(pruned, x=x, w=w):
            return float((x @ w.T - x @ pruned.T).norm())

        joint += error(masks.oneshot.sparsegpt(w, x.T @ x, x.shape[0], 2, 4, scales=scales))
        solved = masks.oneshot.sparsegpt(w, x.T @ x, x.shape[0], 2, 4)
        rounded += error(torch.round(solved / scales[:, None]).clamp(-LEVELS, LEVELS) * scales[:, None])
    assert joint < rounded, (joint, rounded)


def test_bits_is_eight_or_left_out():
    assert nmcompile.recipe("sparsegpt:2:4,bits=8").bits == 8
    assert nmcompile.recipe("wanda:2:4").bits is None
    assert nmcompile.recipe("sparsegpt:2:4,bits=4").bits == 4 and nmcompile.recipe("wanda:2:4,bits=4").group == 64
    with pytest.raises(ValueError, match=r"bits=6 is not supported; bits=8 puts the kept weights on an int8 grid"):
        nmcompile.recipe("sparsegpt:2:4,bits=6")
    with pytest.raises(ValueError, match=r"group=32 is not supported; a 4-bit scale covers 64 or 128"):
        nmcompile.recipe("sparsegpt:2:4,bits=4,group=32")


def _one_shot(spec, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    nmcompile.annotate(model, spec)
    batches = [torch.randn(16, 64) for _ in range(6)]
    nmcompile.finalize(model.eval(), calibration=batches)
    return model, batches


@pytest.mark.parametrize("spec", ["sparsegpt:2:4,bits=8", "wanda:2:4,bits=8"])
def test_finalize_records_the_grid_and_pack_weights_serves_it_exactly(spec):
    model, batches = _one_shot(spec)
    for i in (0, 2):
        scales = records.get(model[i], records.INT8, "weight")
        assert scales is not None and scales.shape == (model[i].weight.shape[0],)
        assert on_grid(model[i].weight.detach(), scales) and nm_ok(model[i].weight.detach(), 2, 4)
    if not cpu24.status().available:
        pytest.skip(f"no 2:4 CPU kernel here: {cpu24.status().reason}")
    x = batches[0]
    with torch.no_grad():
        expected = model(x)
    decisions = nmcompile.deploy.pack_weights(model, measure=False)  # bits left out: the recorded grid is int8
    assert all("the recorded int8 grid" in decisions[k].reason for k in ("0.weight", "2.weight"))
    for i in (0, 2):
        w = model[i].weight
        assert w.quantized and torch.equal(w.scales, records.get(model[i], records.INT8, "weight"))
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)  # no second rounding


def test_a_weight_changed_after_the_solve_is_rounded_again_and_says_so():
    model, _ = _one_shot("sparsegpt:2:4,bits=8")
    if not cpu24.status().available:
        pytest.skip(f"no 2:4 CPU kernel here: {cpu24.status().reason}")
    with torch.no_grad():
        model[0].weight.mul_(1.37)  # fine-tuned, say: off the recorded grid
    decisions = nmcompile.deploy.pack_weights(model, measure=False)
    assert "left the recorded int8 grid" in decisions["0.weight"].reason
    assert "the recorded int8 grid" in decisions["2.weight"].reason


def test_the_joint_solve_s_grid_is_the_first_solve_s_so_the_updates_are_not_clipped():
    """The updates push kept weights past the row's largest magnitude before the solve; the grid is set from a
    first solve without rounding, so the joint solve keeps them (a grid from the weights before would clip)."""
    w, x = weight(24, 64), calibration(256, 64)
    recipe = nmcompile.recipe("sparsegpt:2:4,bits=8")
    first = recipe.solve_columns(w, x.T @ x, x.shape[0])
    assert bool((first.abs() > w.abs().amax(1, keepdim=True)).any())  # what a grid from w would clip
    solved, scales = recipe.solve_quantized(w, x.T @ x, x.shape[0])
    assert torch.equal(scales, row_scales(first)) and on_grid(solved, scales) and nm_ok(solved, 2, 4)
    clipped = masks.oneshot.sparsegpt(w, x.T @ x, x.shape[0], 2, 4, scales=row_scales(w))

    def error(pruned):
        return float((x @ w.T - x @ pruned.T).norm())

    assert error(solved) < error(clipped)
