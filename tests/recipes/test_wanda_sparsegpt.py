"""Wanda and SparseGPT against references written from the papers' equations (tests/reference.py).

The solvers (nmcompile.masks.oneshot) run in float32 with SparseGPT's blocked lazy updates; the
references in float64 with one explicit inverse Hessian per column. Masks must be equal and
weights equal within float32 tolerance; SparseGPT's layer reconstruction error must never be worse
than Wanda's or magnitude's on the same data.
"""

from __future__ import annotations

import pytest
import torch

import nmcompile
from nmcompile import masks
from nmcompile.masks.calibration import from_columns, to_columns

import reference as ref


def calibration(tokens: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Correlated inputs with columns of different scales (as activations are)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, cols, generator=g)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    scale = torch.rand(cols, generator=g) * 3 + 0.1
    return (z @ mix) * scale


def weight(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def nm_ok(w: torch.Tensor, n: int, m: int) -> bool:
    return bool(((w.reshape(w.shape[0], -1, m) != 0).sum(-1) <= n).all())


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (4, 8)])
def test_wanda_matches_the_reference(n, m):
    w, x = weight(16, 32), calibration(64, 32)
    got = masks.oneshot.wanda(w, x.square().sum(0), n, m)
    want = ref.wanda(w, x, n, m)
    assert torch.equal(got != 0, want != 0)
    assert torch.equal(got, want)  # kept weights keep their values
    assert nm_ok(got, n, m)


@pytest.mark.parametrize("n, m, blocksize", [(2, 4, 128), (2, 4, 8), (2, 4, 4), (1, 4, 16), (4, 8, 8), (2, 8, 16)])
def test_sparsegpt_matches_the_reference(n, m, blocksize):
    w, x = weight(12, 32), calibration(200, 32)
    got = masks.oneshot.sparsegpt(w, x.T @ x, x.shape[0], n, m, blocksize=blocksize)
    want, keep = ref.sparsegpt(w, x, n, m)
    assert torch.equal(got != 0, keep)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert nm_ok(got, n, m)


def test_sparsegpt_mask_only_and_dead_inputs_match_the_reference():
    w, x = weight(8, 16), calibration(100, 16)
    x[:, 5] = 0  # an input that never carries signal
    got = masks.oneshot.sparsegpt(w, x.T @ x, x.shape[0], 2, 4, blocksize=8, update=False)
    want, keep = ref.sparsegpt(w, x, 2, 4, update=False)
    assert torch.equal(got != 0, keep & (w != 0))
    torch.testing.assert_close(got, want)
    updated = masks.oneshot.sparsegpt(w, x.T @ x, x.shape[0], 2, 4, blocksize=8)
    want_updated, _ = ref.sparsegpt(w, x, 2, 4)
    torch.testing.assert_close(updated, want_updated, rtol=1e-4, atol=1e-4)
    assert bool((updated[:, 5] == 0).all())


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n, m", [(2, 4), (1, 4)])
def test_sparsegpt_reconstructs_the_layer_at_least_as_well_as_wanda_and_magnitude(seed, n, m):
    w, x = weight(24, 64, seed), calibration(256, 64, seed + 10)

    def error(pruned):
        return float((x @ w.T - x @ pruned.T).norm())

    sgpt = error(masks.oneshot.sparsegpt(w, x.T @ x, x.shape[0], n, m))
    wanda = error(masks.oneshot.wanda(w, x.square().sum(0), n, m))
    magnitude = error(masks.prune(w, n, m, 1))
    mask_only = error(masks.oneshot.sparsegpt(w, x.T @ x, x.shape[0], n, m, update=False))
    assert sgpt <= wanda and sgpt <= magnitude and sgpt <= mask_only, (sgpt, wanda, magnitude, mask_only)


@pytest.mark.parametrize("shape, dim", [((6, 8), 1), ((8, 6), 0), ((6, 8, 3, 3), 1), ((6, 8, 5), 1), ((3, 6, 8), -1),
                                        ((3, 8, 6), -2)])
def test_column_layout_groups_along_the_reduction_dim(shape, dim):
    w = torch.randn(shape)
    columns = to_columns(w, dim)
    assert torch.equal(from_columns(columns, w.shape, dim), w)
    # pruning the columns in groups of 4 is pruning the weight along its reduction dim
    if len(shape) == 3 and dim < 0:
        want = torch.stack([masks.prune(w[e], 2, 4, dim + 2) for e in range(shape[0])])
    else:
        want = masks.prune(w, 2, 4, dim)
    assert torch.equal(from_columns(masks.prune(columns, 2, 4, -1), w.shape, dim), want)


@pytest.mark.parametrize("spec, match", [
    ("sparsegpt:2:4,blocksize=6", "blocksize=6 must be a positive multiple of m=4"),
    ("sparsegpt:2:4,blocksize=0", "blocksize=0"),
    ("sparsegpt:2:4,percdamp=-0.1", "percdamp=-0.1 must be a float in \\[0, 1\\)"),
    ("sparsegpt:2:4,percdamp=nan", "not a finite number"),
    ("sparsegpt:2:4,update=maybe", "update='maybe' is not a valid bool"),
    ("sparsegpt:2:4,percdam=0.1", "unknown key 'percdam' for recipe 'sparsegpt' \\(did you mean 'percdamp'\\?\\)"),
    ("wanda:2:4,blocksize=128", "unknown key 'blocksize' for recipe 'wanda'"),
    ("wanda:2:4,wgrad=mvue24", "wanda: wgrad='mvue24' does not apply"),
    ("wanda:4:4", "invalid N:M pattern 4:4"),
    ("sparsgpt:2:4", "did you mean 'sparsegpt'"),
])
def test_keys_are_validated(spec, match):
    with pytest.raises(ValueError, match=match):
        nmcompile.recipes.parse(spec)


def test_recipe_strings_round_trip():
    for spec in ("wanda:2:4", "wanda:1:8", "sparsegpt:2:4", "sparsegpt:4:8,blocksize=64,percdamp=0.05,update=False"):
        assert str(nmcompile.recipes.parse(spec)) == spec
