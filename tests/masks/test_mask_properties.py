"""Property-based checks of the mask functions over random shapes, patterns, ties, zeros and extreme magnitudes."""

import pytest
import torch

import nmcompile.masks as masks
import reference

hypothesis = pytest.importorskip("hypothesis", reason="pip install hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MAGNITUDES = [0.0, 1e-40, 1e-30, 1e-6, 1.0, 3.0, 1e30, 3e38]  # zeros, denormals, tiny, huge


@st.composite
def weights(draw, max_m=32):
    m = draw(st.sampled_from([m for m in (2, 4, 8, 16, 32) if m <= max_m]))
    n = draw(st.integers(1, m - 1))
    rows = draw(st.integers(1, 6))
    groups = draw(st.integers(1, 4))
    dim = draw(st.sampled_from([0, 1]))
    kind = draw(st.sampled_from(["normal", "ties", "extreme"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (groups * m, rows) if dim == 0 else (rows, groups * m)
    if kind == "normal":
        w = torch.randn(shape, generator=gen)
    elif kind == "ties":
        w = torch.randint(-2, 3, shape, generator=gen).float()
    else:
        pick = torch.randint(len(MAGNITUDES), shape, generator=gen)
        sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
        w = torch.tensor(MAGNITUDES)[pick] * sign
    return w, n, m, dim


@settings(max_examples=150, deadline=None)
@given(weights())
def test_hard_masks_keep_exactly_n_and_match_the_reference(case):
    w, n, m, dim = case
    keep = masks.keep_mask(w, n, m, dim)
    per_group = keep.movedim(dim, -1).unflatten(-1, (-1, m)).sum(-1)
    assert (per_group == n).all()
    assert torch.equal(keep, reference.topn_mask(w, n, m, dim))  # ties go to the lower index
    assert torch.equal(keep, masks.keep_mask(w.clone(), n, m, dim))  # deterministic
    pruned = masks.prune(w, n, m, dim)
    assert torch.equal(pruned, torch.where(keep, w, torch.zeros_like(w)))
    assert masks.count_violations(pruned, n, m, dim)[0] == 0


@settings(max_examples=100, deadline=None)
@given(weights())
def test_soft_threshold_keeps_at_most_n_and_shrinks_towards_zero(case):
    w, n, m, dim = case
    s = masks.soft_threshold(w, n, m, dim)
    assert torch.isfinite(s).all()
    assert masks.count_violations(s, n, m, dim)[0] == 0
    assert (s.abs() <= w.abs()).all() and ((s == 0) | (torch.sign(s) == torch.sign(w))).all()
    torch.testing.assert_close(s, reference.soft_threshold(w, n, m, dim), atol=0, rtol=1e-6)


@st.composite
def tiled(draw):
    m = draw(st.sampled_from([2, 4, 8]))
    n = draw(st.integers(1, m - 1))
    shape = (draw(st.integers(1, 3)) * m, draw(st.integers(1, 3)) * m)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ties = draw(st.booleans())
    w = torch.randint(-2, 3, shape, generator=gen).float() if ties else torch.randn(shape, generator=gen)
    return w, n, m


@settings(max_examples=60, deadline=None)
@given(tiled(), st.sampled_from(["exact", "greedy"]))
def test_transposable_masks_hold_both_tile_constraints(case, method):
    w, n, m = case
    mask = masks.transposable_mask(w, n, m, method)
    assert masks.is_transposable(mask, n, m)
    assert torch.equal(mask, masks.transposable_mask(w.clone(), n, m, method))  # deterministic


@pytest.mark.parametrize("n,m,dim,width", [(2, 4, 1, 64), (2, 4, 1, 8), (2, 4, 0, 64), (1, 8, 1, 64), (3, 16, 1, 32)])
def test_nan_and_inf_weights_never_break_the_n_m_count(n, m, dim, width):
    """NaN counts as the largest magnitude (kept; it reaches the output as in dense training), inf likewise."""
    w = torch.randn(32, width) if dim == 1 else torch.randn(width, 32)
    w.view(-1)[::7] = float("nan")
    w.view(-1)[3::11] = float("inf")
    w.view(-1)[5::13] = -float("inf")
    keep = masks.keep_mask(w, n, m, dim)
    assert (keep.movedim(dim, -1).unflatten(-1, (-1, m)).sum(-1) == n).all()
    lone = torch.randn(4, 16)
    lone[1, 5] = float("nan")  # the only non-finite value of its group: kept, like the largest magnitude
    assert masks.keep_mask(lone, n=2, m=4, dim=1)[1, 5]
    pruned = masks.prune(w, n, m, dim)
    assert masks.count_violations(pruned, n, m, dim)[0] == 0
    assert masks.count_violations(torch.compile(masks.prune)(w, n, m, dim), n, m, dim)[0] == 0
    # S-STE's shrink of a group holding NaN/inf is NaN/inf arithmetic (documented); every finite group stays valid
    groups = masks.soft_threshold(w, n, m, dim).movedim(dim, -1).unflatten(-1, (-1, m))
    finite = torch.isfinite(w.movedim(dim, -1).unflatten(-1, (-1, m))).all(-1)
    assert ((groups != 0).sum(-1)[finite] <= n).all()
