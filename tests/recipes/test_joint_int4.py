"""SparseGPT's joint sparsification and 4-bit quantization (``sparsegpt:2:4,bits=4``, a scale per row and group of
columns) and Wanda's round to nearest (``wanda:2:4,bits=4``): the solver against the float64 reference written from
the paper's equations (tests/reference.py), the grid recorded by ``finalize`` and served by ``pack_weights``
without a second rounding, and saved with them (``model_int4.safetensors``) so a packed load holds them too."""

from __future__ import annotations

import pytest
import torch

import nmcompile
from nmcompile import masks
from nmcompile.kernels import cpu24
from nmcompile.kernels.cpu24.quantize import group_scales, round_groups4
from nmcompile.state import records

import reference as ref
from test_wanda_sparsegpt import calibration, nm_ok, weight


def on_grid4(w, scales):
    """Whether every entry of ``w`` is ``k * s`` of its row's and group's scale, ``-8 <= k <= 7``."""
    s = scales.double().repeat_interleave(w.shape[1] // scales.shape[1], dim=1)
    steps = torch.where(s != 0, w.double() / torch.where(s != 0, s, 1.0), 0.0)
    return bool(((steps - steps.round()).abs() < 1e-3).all() and (steps >= -8 - 1e-3).all() and (steps <= 7 + 1e-3).all()
                and (w[s == 0] == 0).all())


@pytest.mark.parametrize("group", [64, 128])
def test_the_joint_solve_matches_the_reference(group):
    w, x = weight(12, 256), calibration(300, 256)
    scales = group_scales(w, 2 * group)
    got = masks.oneshot.sparsegpt(w, x.T @ x, x.shape[0], 2, 4, scales=scales, levels=(-8, 7))
    want, keep = ref.sparsegpt(w, x, 2, 4, scales=scales, levels=(-8, 7))
    assert torch.equal(got != 0, keep & (want != 0))  # a kept entry may round to zero
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert nm_ok(got, 2, 4) and on_grid4(got, scales)


def test_the_joint_solve_reconstructs_better_than_rounding_after_the_solve():
    """Greedy, so not on every matrix: over eight, its reconstruction error is the smaller one in sum."""
    joint = rounded = 0.0
    recipe = nmcompile.recipe("sparsegpt:2:4,bits=4")
    for seed in range(8):
        w, x = weight(24, 128, seed), calibration(256, 128, seed + 10)

        def error(pruned, x=x, w=w):
            return float((x @ w.T - x @ pruned.T).norm())

        solved, scales = recipe.solve_quantized(w, x.T @ x, x.shape[0])
        assert on_grid4(solved, scales) and nm_ok(solved, 2, 4)
        joint += error(solved)
        rounded += error(round_groups4(recipe.solve_columns(w, x.T @ x, x.shape[0]), 64))
    assert joint < rounded, (joint, rounded)


def _one_shot(spec, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    nmcompile.annotate(model, spec)
    batches = [torch.randn(16, 128) for _ in range(6)]
    nmcompile.finalize(model.eval(), calibration=batches)
    return model, batches


@pytest.mark.parametrize("spec", ["sparsegpt:2:4,bits=4", "wanda:2:4,bits=4", "sparsegpt:2:4,bits=4,group=128"])
def test_finalize_records_the_grid_and_pack_weights_serves_it_exactly(spec):
    model, batches = _one_shot(spec)
    group = 128 if "group=128" in spec else 64
    solved = [0, 2]
    for i in solved:
        scales = records.get(model[i], records.INT4, "weight")
        assert scales is not None and scales.dtype == torch.float16
        assert scales.shape == (model[i].weight.shape[0], model[i].weight.shape[1] // group)
        assert on_grid4(model[i].weight.detach(), scales) and nm_ok(model[i].weight.detach(), 2, 4)
        assert records.get(model[i], records.INT8, "weight") is None
    if not cpu24.status().available or "avx2" not in cpu24.isas():
        pytest.skip("4-bit values run on the AVX2 kernel")
    dense = {i: model[i].weight.detach().clone() for i in solved}
    decisions = nmcompile.deploy.pack_weights(model, measure=False)  # bits left out: the recorded grids are 4-bit
    for i in solved:
        assert f"the recorded 4-bit grid (groups of {group})" in decisions[f"{i}.weight"].reason
        w = model[i].weight
        assert w.int4 and w.group == group and torch.equal(w.dense(), dense[i])  # no second rounding
    nmcompile.deploy.pack_weights(model, measure=False)  # idempotent, its group kept
    assert all(model[i].weight.group == group for i in solved)


def test_a_weight_changed_after_the_solve_is_rounded_again_and_says_so():
    model, _ = _one_shot("sparsegpt:2:4,bits=4")
    if "avx2" not in cpu24.isas():
        pytest.skip("4-bit values run on the AVX2 kernel")
    with torch.no_grad():
        model[0].weight.mul_(1.37)  # fine-tuned, say: off the recorded grid
    decisions = nmcompile.deploy.pack_weights(model, measure=False)
    assert "left the recorded grid" in decisions["0.weight"].reason
    assert "the recorded 4-bit grid" in decisions["2.weight"].reason


def test_a_width_that_is_not_a_multiple_of_the_group_is_refused_by_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64))
    nmcompile.annotate(model, "sparsegpt:2:4,bits=4")
    with pytest.raises(ValueError, match=r"0.weight .*96 input columns are not a multiple of group=64"):
        nmcompile.finalize(model.eval(), calibration=[torch.randn(16, 96)])


def test_a_hugging_face_model_with_4_bit_grids_saves_and_loads_packed_on_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    from models import tiny_llama

    if "avx2" not in cpu24.isas():
        pytest.skip("4-bit values run on the AVX2 kernel")
    torch.manual_seed(0)
    model = tiny_llama(transformers, hidden=128, intermediate=256).eval()
    nmcompile.annotate(model, "sparsegpt:2:4,bits=4,group=128", exclude=["lm_head"])
    nmcompile.finalize(model, calibration=[torch.randint(0, 256, (2, 16)) for _ in range(2)])
    nmcompile.deploy.save_pretrained(model, tmp_path / "out")
    grids = {n: records.get(model.get_submodule(n.rsplit(".", 1)[0]), records.INT4, "weight")
             for n, _ in model.named_parameters() if n.endswith("proj.weight")}
    decisions = nmcompile.deploy.pack_weights(model, measure=False)  # in this process, on the solve's grids
    assert all("the recorded 4-bit grid (groups of 128)" in decisions[n].reason for n in grids)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        expected = model(ids).logits
    loaded = nmcompile.deploy.load_pretrained(tmp_path / "out", packed=True, measure=False)
    for name, grid in grids.items():  # the solve's grid, not a second rounding
        p = loaded.get_parameter(name)
        assert p.int4 and p.group == 128 and torch.equal(p.dense(), model.get_parameter(name).dense()), name
        assert torch.equal(records.get(loaded.get_submodule(name.rsplit(".", 1)[0]), records.INT4, "weight"), grid)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec, key", [("sparsegpt:2:4,bits=8", records.INT8), ("sparsegpt:2:4,bits=4", records.INT4)])
def test_a_sequential_solve_from_a_calibration_function_records_its_grids(spec, key):
    transformers = pytest.importorskip("transformers")
    from models import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(transformers, hidden=128, intermediate=256).eval()
    nmcompile.annotate(model, spec, exclude=["lm_head"])
    batches = [torch.randint(0, 256, (2, 16)) for _ in range(2)]
    compiled = torch.compile(model, backend="nmsparse")

    def calibration():
        with torch.no_grad():
            for ids in batches:
                compiled(ids)

    nmcompile.finalize(model, calibration=calibration, sequential=True)
    for layer in model.model.layers:  # each block's weights, solved one block at a time, keep their grids
        assert records.get(layer.mlp.down_proj, key, "weight") is not None
        assert records.get(layer.self_attn.q_proj, key, "weight") is not None
