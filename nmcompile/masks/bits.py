"""Boolean masks packed 64 columns to an int64 word, and the counts taken over them.

Used where one mask is scored under many row orders (Bi-Mask's permutation search): gathering
packed rows moves 8x fewer bytes than gathering a bool mask (64 columns in 8 bytes), and the N:M
counts become a few bitwise operations per word.
"""

from __future__ import annotations

import torch

from .topn import at_least_levels

_BITS = 64
# SWAR popcount constants; each has bit 63 clear, so arithmetic right shifts give the same bits
_M1, _M2, _M4 = 0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F


def pack_columns(mask: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` bool -> ``[rows, ceil(cols / 64)]`` int64; column c is bit c % 64 of word c // 64."""
    rows, cols = mask.shape
    words = -(-cols // _BITS)
    bits = torch.zeros(rows, words * _BITS, dtype=torch.int64, device=mask.device)
    bits[:, :cols] = mask
    shifts = torch.arange(_BITS, dtype=torch.int64, device=mask.device)
    # distinct bits: their sum is their bitwise or (bit 63 wraps to the sign bit, as intended)
    return (bits.view(rows, words, _BITS) << shifts).sum(-1)


def popcount(words: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The number of set bits of int64 ``words``, summed over ``dims``."""
    x = words - ((words >> 1) & _M1)
    x = (x & _M2) + ((x >> 2) & _M2)
    x = (x + (x >> 4)) & _M4  # every byte holds its own bit count (<= 8); x >= 0 from here on
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)  # the low byte holds the word's count (<= 64); adds only, no overflow
    return (x & 0x7F).sum(dims)


def capped_group_counts(rows: torch.Tensor, n: int) -> torch.Tensor:
    """``sum over groups and columns of min(n, set bits in the group's column)``, per candidate.

    ``rows``: ``[m, K, groups, W]`` packed rows: ``rows[i, k, g]`` is row i of group g under
    candidate k. Returns ``[K]``: ``min(n, c)`` is the number of levels t <= n with ``c >= t``,
    so it adds up the popcounts of the bit-sliced "at least t of the m rows" words.
    """
    levels = [level for level in at_least_levels(list(rows), n) if level is not None]
    return sum(popcount(level, (1, 2)) for level in levels)
