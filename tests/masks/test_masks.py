import pytest
import torch

import nmcompile
from nmcompile import masks
from nmcompile.pattern import NMPattern

import reference

PATTERNS = [(1, 2), (2, 4), (1, 4), (3, 4), (2, 8), (4, 8), (1, 8), (1, 16), (1, 32)]


def test_hand_computed_2_4_mask():
    w = torch.tensor([[1.0, -3.0, 2.0, -0.5, 0.0, 0.0, 0.0, 0.0]])
    assert masks.keep_mask(w, 2, 4).tolist() == [[False, True, True, False, True, True, False, False]]
    assert masks.prune(w, 2, 4).tolist() == [[0.0, -3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]]


def test_hand_computed_soft_threshold():
    # |w| = 4, 1, 3, 2 -> t = 2 (third largest): 4-2 and 3-2 kept, signs kept
    w = torch.tensor([[-4.0, 1.0, 3.0, 2.0]])
    assert masks.soft_threshold(w, 2, 4).tolist() == [[-2.0, 0.0, 1.0, 0.0]]


@pytest.mark.parametrize("n,m", PATTERNS, ids=lambda v: str(v))
def test_masks_match_reference(n, m):
    w = torch.randn(16, 4 * m)
    torch.testing.assert_close(masks.keep_mask(w, n, m, 1), reference.topn_mask(w, n, m, 1))
    torch.testing.assert_close(masks.prune(w, n, m, 1), w * reference.topn_mask(w, n, m, 1))
    torch.testing.assert_close(masks.soft_threshold(w, n, m, 1), reference.soft_threshold(w, n, m, 1))


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 4), (4, 8)], ids=lambda v: str(v))
def test_ties_keep_exactly_n_lower_index_first(n, m):
    w = torch.randint(-2, 3, (64, 4 * m)).float()  # many ties and all-zero groups
    keep = masks.keep_mask(w, n, m, 1)
    assert (keep.unflatten(1, (-1, m)).sum(-1) == n).all()
    torch.testing.assert_close(keep, reference.topn_mask(w, n, m, 1))
    torch.testing.assert_close(masks.soft_threshold(w, n, m, 1), reference.soft_threshold(w, n, m, 1))


def test_other_dims_group_along_that_dim():
    conv = torch.randn(6, 8, 3, 3)  # [out, in, kh, kw]: groups along input channels
    torch.testing.assert_close(masks.prune(conv, 2, 4, 1), conv * reference.topn_mask(conv, 2, 4, 1))
    gpt2 = torch.randn(8, 5)  # Conv1D [in, out]: groups along dim 0
    kept = masks.keep_mask(gpt2, 2, 4, 0)
    assert (kept.unflatten(0, (-1, 4)).sum(1) == 2).all()


@pytest.mark.parametrize("init,expected", [("uniform", 1.75), ("normal", 1.48)])
def test_beta_matches_paper_values(init, expected):
    w = torch.empty(4096, 1024)
    torch.nn.init.kaiming_uniform_(w, a=5**0.5) if init == "uniform" else torch.nn.init.normal_(w, std=0.02)
    beta = masks.soft_threshold_scale(w, 2, 4, 1)
    assert beta.dtype == torch.float32 and beta.dim() == 0
    assert abs(beta.item() - expected) < 0.02
    torch.testing.assert_close(beta, reference.beta(w, 2, 4, 1))


def test_beta_of_zero_weight_is_one():
    assert masks.soft_threshold_scale(torch.zeros(4, 8), 2, 4, 1).item() == 1.0


def test_count_violations():
    t = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]])
    assert masks.count_violations(t, 2, 4, 1) == (1, 2)


@pytest.mark.parametrize("n,m", [(0, 4), (4, 4), (5, 4), (-1, 2)])
def test_pattern_rejects_bad_n(n, m):
    with pytest.raises(ValueError, match="1 <= N < M"):
        NMPattern(n, m)


def test_pattern_fits_names_the_fix():
    reason = NMPattern(2, 4).fits(torch.zeros(3, 10), 1)
    assert "not divisible by M=4" in reason and "pad it to 12" in reason
    assert "not floating point" in NMPattern(2, 4).fits(torch.zeros(3, 8, dtype=torch.int8), 1)


@pytest.mark.parametrize("width", [4, 8, 12, 16, 20, 64, 1024])
@pytest.mark.parametrize("ties", [False, True])
def test_2_4_fast_path_matches_reference_at_every_width(width, ties):
    w = torch.randint(-2, 3, (8, width)).float() if ties else torch.randn(8, width)
    torch.testing.assert_close(masks.prune(w, 2, 4, 1), w * reference.topn_mask(w, 2, 4, 1))
    torch.testing.assert_close(masks.soft_threshold(w, 2, 4, 1), reference.soft_threshold(w, 2, 4, 1))
    beta = torch.tensor(1.3)
    torch.testing.assert_close(
        masks.soft_threshold(w, 2, 4, 1, scale=beta), beta * reference.soft_threshold(w, 2, 4, 1)
    )


@pytest.mark.parametrize("shape,dim", [((64, 1024), 1), ((16, 32, 3, 3), 1), ((32, 24), 0)])
def test_inductor_compiled_masks_match_reference(shape, dim):
    w = torch.randn(shape)
    w[0].zero_()  # all-zero groups
    w[1] = w[1].round()  # ties
    prune = torch.compile(masks.prune, backend="inductor", fullgraph=True)
    soft = torch.compile(masks.soft_threshold, backend="inductor", fullgraph=True)
    torch.testing.assert_close(prune(w, 2, 4, dim), w * reference.topn_mask(w, 2, 4, dim))
    torch.testing.assert_close(soft(w, 2, 4, dim), reference.soft_threshold(w, 2, 4, dim))


@pytest.mark.parametrize("n,m", [(1, 2), (1, 4), (2, 4), (3, 4), (1, 8), (4, 8), (7, 8), (3, 16)], ids=str)
@pytest.mark.parametrize("shape,dim", [((32, 48), 0), ((8, 32, 2, 3), 1), ((8, 16, 32), 1)], ids=str)
def test_groups_along_a_leading_dim_match_reference(n, m, shape, dim):
    """Groups followed by >= 16 elements are compared run against run (m <= 8); m = 16 takes the rank path."""
    if shape[dim] % m:
        pytest.skip("dim not divisible by m")
    w = torch.randn(shape)
    w.select(dim, 0).zero_()  # all-zero groups
    w.narrow(dim + 1, 0, 1).round_()  # ties
    expected = reference.topn_mask(w, n, m, dim)
    torch.testing.assert_close(masks.keep_mask(w, n, m, dim), expected)
    torch.testing.assert_close(masks.prune(w, n, m, dim), w * expected)
    if (n, m) in ((2, 4), (1, 8)) and len(shape) == 2:  # Inductor's code for the same math
        torch.testing.assert_close(torch.compile(masks.prune)(w, n, m, dim), w * expected)
        torch.testing.assert_close(torch.compile(masks.keep_mask)(w, n, m, dim), expected)
    assert (expected.movedim(dim, -1).unflatten(-1, (-1, m)).sum(-1) == n).all()


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 8)], ids=str)
@pytest.mark.parametrize("shape", [(32, 24), (16, 8, 3, 3), (64, 1024)], ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_prune_row_groups_is_prune_of_the_reordered_rows(n, m, shape, compiled):
    """Pruning along axis 0 in groups of rows taken in ``order`` = pruning ``w[order]``, rows put back."""
    torch.manual_seed(0)
    w = torch.randn(shape)
    w[:4].zero_()  # all-zero groups, if the order groups these rows together
    w[4:8] = w[4:8].round()  # ties across rows
    w[8] = w[9]  # exact ties between two rows
    order = torch.randperm(shape[0])
    expected = torch.empty_like(w)
    expected[order] = w[order] * reference.topn_mask(w[order], n, m, 0)
    fn = torch.compile(masks.prune_row_groups, fullgraph=True) if compiled else masks.prune_row_groups
    torch.testing.assert_close(fn(w, order, n, m), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [1, 0], ids=["out-axis-0", "out-axis-1"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_bi_mask_backward_weight_matches_reference_at_either_out_axis(dim, compiled):
    from nmcompile import ops

    torch.manual_seed(0)
    w = torch.randn(32, 24)
    w[:, :4] = w[:, :4].round()  # ties
    w_out_rows = w if dim == 1 else w.t()  # the reference takes [out, in]
    perm = torch.randperm(w_out_rows.shape[0])
    expected = w_out_rows * reference.bi_mask_backward_mask(w_out_rows, perm, 2, 4)
    kept = masks.prune(w, 2, 4, dim)
    fn = torch.compile(ops._backward_mask_weight, fullgraph=True) if compiled else ops._backward_mask_weight
    got = fn(kept, perm, 2, 4, dim)
    torch.testing.assert_close(got if dim == 1 else got.t(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 8)], ids=str)
@pytest.mark.parametrize("shape,dim", [((16, 64), 1), ((16, 8), 1), ((32, 48), 0)], ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_prune_when_switches_between_prune_and_identity(n, m, shape, dim, compiled):
    """``prune_when``: the N:M prune while ``on`` holds, the weight itself otherwise; its gradient is
    straight-through plus ``decay * (w - out)``, which vanishes while it is off."""
    torch.manual_seed(0)
    decay = 0.25
    w = torch.randn(shape)
    w.narrow(dim, 0, m).round_()  # ties
    g = torch.randn(shape)
    prune = torch.compile(masks.prune, fullgraph=True) if compiled else masks.prune  # the traced math
    for on in (True, False):
        expected = w * reference.topn_mask(w, n, m, dim) if on else w
        torch.testing.assert_close(prune(w, n, m, dim, on=torch.tensor(on)), expected, rtol=0, atol=0)
        wr = w.clone().requires_grad_()
        out = torch.ops.nmsparse.prune_when(wr, torch.tensor(on), n, m, dim, decay)
        out.backward(g)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(wr.grad, g + decay * (w - expected))


@pytest.mark.parametrize("n,m", [(1, 32), (3, 32), (17, 32), (1, 1024), (100, 1024)], ids=str)
def test_large_groups_match_reference_with_ties(n, m):
    """Groups larger than PAIRWISE_MAX_M sort instead of comparing every pair: same masks, same ties."""
    assert m > masks.topn.PAIRWISE_MAX_M
    torch.manual_seed(0)
    w = torch.randint(-2, 3, (8, 4096)).float()  # many ties
    w[0].zero_()  # all-zero groups
    expected = reference.topn_mask(w, n, m, 1)
    assert (expected.unflatten(1, (-1, m)).sum(-1) == n).all()
    torch.testing.assert_close(masks.keep_mask(w, n, m, 1), expected, rtol=0, atol=0)
    torch.testing.assert_close(masks.prune(w, n, m, 1), w * expected, rtol=0, atol=0)
    torch.testing.assert_close(masks.keep_mask(w.t(), n, m, 0), expected.t(), rtol=0, atol=0)
    torch.testing.assert_close(masks.soft_threshold(w, n, m, 1), reference.soft_threshold(w, n, m, 1), rtol=0, atol=0)
    if (n, m) == (3, 32):  # Inductor's code for the sort
        torch.testing.assert_close(torch.compile(masks.prune)(w, n, m, 1), w * expected, rtol=0, atol=0)


def test_prune_row_groups_of_large_groups_matches_reference():
    torch.manual_seed(0)
    w = torch.randint(-2, 3, (64, 24)).float()
    order = torch.randperm(64)
    expected = torch.empty_like(w)
    expected[order] = w[order] * reference.topn_mask(w[order], 3, 32, 0)
    torch.testing.assert_close(masks.prune_row_groups(w, order, 3, 32), expected, rtol=0, atol=0)


def test_large_groups_keep_nan_and_exactly_n():
    w = torch.randn(4, 64)
    w[1, 5] = float("nan")
    keep = masks.keep_mask(w, 2, 64, 1)
    assert keep[1, 5] and (keep.sum(1) == 2).all()
    assert masks.soft_threshold(w, 2, 64, 1)[1].isnan().all()  # as for small groups: t is NaN


def test_one_of_4096_needs_memory_linear_in_the_weight():
    """Comparing every pair in each group would take 256 * 4096 * 4096 bools and int32 ranks (~20 GB)."""
    torch.manual_seed(0)
    w = torch.randn(256, 4096)
    keep = masks.keep_mask(w, 1, 4096, 1)
    assert torch.equal(keep.nonzero()[:, 1], w.abs().argmax(1))
    assert torch.equal(masks.prune(w, 1, 4096, 1), w * keep)
    soft = masks.soft_threshold(w, 1, 4096, 1)
    assert (soft != 0).sum(1).le(1).all() and torch.equal(soft != 0, keep & (soft != 0))
    projected = nmcompile.recipe("sr_ste:1:4096").project(w, dim=1)
    assert torch.equal(projected, w * keep)
