"""Packed-bit masks and the counts Bi-Mask's permutation search takes over them."""

import pytest
import torch

import reference
from nmcompile.masks import bits
from nmcompile.recipes.bi_mask import shared_kept


def unpack(words, cols):
    shifts = torch.arange(64)
    return ((words.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :cols].bool()


@pytest.mark.parametrize("cols", [1, 63, 64, 65, 130])
def test_pack_columns_round_trips_every_bit(cols):
    torch.manual_seed(cols)
    mask = torch.rand(7, cols) < 0.5
    mask[0] = True  # a full row: every word's bit 63 (the sign bit) is set where cols reach it
    packed = bits.pack_columns(mask)
    assert packed.shape == (7, -(-cols // 64)) and packed.dtype == torch.int64
    assert torch.equal(unpack(packed, cols), mask)
    assert torch.equal(bits.popcount(packed, (-1,)), mask.sum(1))


def test_popcount_of_extreme_words():
    words = torch.tensor([0, -1, -(2**63), 2**63 - 1, 1, 0x5555555555555555])
    assert bits.popcount(words.view(-1, 1), (-1,)).tolist() == [0, 64, 1, 63, 1, 32]


@pytest.mark.parametrize("n, m", [(1, 2), (2, 4), (1, 4), (3, 4), (2, 8), (5, 8)])
def test_capped_group_counts_is_the_sum_of_min_n_and_count(n, m):
    torch.manual_seed(n * 10 + m)
    mask = torch.rand(3, 4 * m, 100) < 0.6  # three candidates, four groups of m rows
    expected = mask.unflatten(1, (-1, m)).sum(2).clamp(max=n).sum((1, 2))
    packed = torch.stack([bits.pack_columns(x) for x in mask])  # [3, 4m, W]
    rows = packed.unflatten(1, (-1, m)).permute(2, 0, 1, 3)  # [m, 3, 4, W]
    assert torch.equal(bits.capped_group_counts(rows, n), expected)


@pytest.mark.parametrize("shape, n, m", [((32, 16), 2, 4), ((64, 80), 1, 4), ((16, 200), 4, 8), ((24, 8, 3, 3), 2, 4)])
def test_shared_kept_counts_the_weights_both_masks_keep(shape, n, m):
    torch.manual_seed(0)
    w = torch.randn(shape)
    perms = torch.stack([torch.arange(shape[0])] + [torch.randperm(shape[0]) for _ in range(4)])
    expected = [int(reference.bi_mask_backward_mask(w, p, n, m).sum()) for p in perms]
    assert shared_kept(w, perms, n, m, 1).tolist() == expected


def test_shared_kept_ignores_zero_weights():
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    w[:4, :4] = 0  # F keeps two zeros in each of these rows' first group: no weight to keep
    perm = torch.randperm(8)
    kept = reference.topn_mask(w, 2, 4, 1) & (w != 0)
    expected = kept[perm].unflatten(0, (-1, 4)).sum(1).clamp(max=2).sum()
    assert int(shared_kept(w, perm.unsqueeze(0), 2, 4, 1)) == int(expected)
    assert int(expected) < int(reference.topn_mask(w, 2, 4, 1)[perm].unflatten(0, (-1, 4)).sum(1).clamp(max=2).sum())
