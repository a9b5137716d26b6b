"""The integer grids 2:4 weights' kept values are rounded to (int8 rows, 4-bit groups), as plain tensor math.

Shared by the CPU kernels' layouts (:mod:`nmcompile.kernels.cpu24.quantize`, which adds the input checks), the
one-shot solves' ``bits=`` and the ``nmsparse::round_to_grid`` op a training recipe rounds its forward weight with
(``asp:2:4,bits=4``: the recovered model trains on the values the packed model serves). No data-dependent Python
branch: these trace into a compiled graph.

- int8 (``bits=8``): one fp32 scale per row, its largest magnitude over :data:`LEVELS` (1 for a row of zeros);
  codes ``round(w / scale)`` in -127..127.
- 4-bit (``bits=4``): one scale per row and ``group`` positions along the row, the group's value of largest
  magnitude over -8, rounded to fp16 (so that value lands on code -8 exactly); codes ``round(w / scale)`` in
  -8..7, and 0 for a group whose scale is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LEVELS", "LOW4", "HIGH4", "GROUP_SIZES", "row_grid", "group_grid", "on_row_grid", "on_group_grid",
           "round_to_grid"]

#: the largest int8 code used: the grid is -LEVELS..LEVELS (symmetric: negating a weight negates its code)
LEVELS = 127
#: the 4-bit grid's codes: LOW4..HIGH4
LOW4, HIGH4 = -8, 7
#: the positions one 4-bit scale may cover
GROUP_SIZES = (64, 128)


def row_grid(rows: Tensor) -> Tensor:
    """fp32 ``[rows]``: each row's largest magnitude over :data:`LEVELS`, 1 for a row of zeros."""
    top = rows.reshape(rows.shape[0], -1).float().abs().amax(1)
    return torch.where(top > 0, top / LEVELS, torch.ones_like(top))


def group_grid(rows: Tensor, per: int) -> Tensor:
    """fp16 ``[rows, cols / per]``: each run of ``per`` values of a row, its value of largest magnitude over
    :data:`LOW4` (-8), rounded to fp16 (0 for a run of zeros)."""
    groups = rows.float().reshape(rows.shape[0], -1, per)
    top = groups.gather(2, groups.abs().argmax(2, keepdim=True)).squeeze(2)
    return (top / LOW4).to(torch.float16)


def on_row_grid(rows: Tensor, scales: Tensor) -> Tensor:
    """fp32 ``rows [rows, cols]`` rounded to nearest (ties to even) on the int8 grids of ``scales [rows]``."""
    s = scales.float()[:, None]
    return torch.round(rows.float() / s).clamp(-LEVELS, LEVELS) * s


def on_group_grid(rows: Tensor, scales: Tensor) -> Tensor:
    """fp32 ``rows [rows, cols]`` rounded to nearest on the 4-bit grids of the fp16 ``scales [rows, cols / per]``
    (zeros where a scale is 0)."""
    n, cols = rows.shape
    d = scales.float()[..., None]
    groups = rows.float().reshape(n, scales.shape[1], -1)
    codes = torch.where(d != 0, torch.round(groups / torch.where(d != 0, d, 1.0)), 0.0).clamp(LOW4, HIGH4)
    return (codes * d).reshape(n, cols)


def round_to_grid(w: Tensor, bits: int, group: int, dim: int) -> Tensor:
    """``w`` (2-D, rows along the other dim than ``dim``, the reduction dim) with each row rounded to its own grid
    (``bits=8``: int8 rows; ``bits=4``: 4-bit groups of ``group`` positions), in ``w``'s dtype."""
    rows = w if dim % 2 == 1 else w.t()
    if bits == 8:
        out = on_row_grid(rows, row_grid(rows))
    else:
        out = on_group_grid(rows, group_grid(rows, group))
    out = out.to(w.dtype)
    return out if dim % 2 == 1 else out.t()
