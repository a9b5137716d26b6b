"""2:4 weights with 4-bit values: each row's kept values in groups along the reduction dim, a scale per group.

A group covers ``group`` positions of a row (64 or 128: 32 or 64 kept values). Its scale ``d`` is the group's
kept value of largest magnitude divided by -8, rounded to fp16, and each value's code is ``round(w / d)``
clamped to -8..7: the value of largest magnitude lands on -8 exactly, the grid has 16 levels, and a value's
dequantized weight is ``code * d`` (fp16 ``d`` widened to fp32). A group of zeros (or of values too small for an
fp16 scale: below about 5e-7) has ``d = 0`` and codes 0. Bits a weight: 2 (4-bit values at half the positions)
+ 1 (the position bits) + 16 / group (the scale): 3.25 at group 64, 3.125 at 128 (llama.cpp's Q4_0: 4.5).

The layout (``nmsparse::cpu24_linear_q4``, ``cpu24_a8.cpp``) holds the codes of the CPU layout's kept values
per row group of :data:`~nmcompile.kernels.cpu24.GROUP` rows, per kernel step of 64 positions (4 words), per
pair of rows: 32 bytes whose byte ``16 * lane + i`` holds, offset by 8 (0..15), the pair's first row's code in
its low nibble and the second row's in its high nibble, of kept value ``i`` of words ``2 * lane`` and
``2 * lane + 1`` (8 kept values a word): one 32-byte load gives both rows' 32 codes of the step as two
registers, one ``and`` and one shift apart. The scales are fp16 ``[groups, K / group, GROUP]``: a step reads
its 8 rows' scales in one 16-byte load.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["GROUP_SIZES", "LOW", "HIGH", "group_scales", "quantize_layout4", "dequantize_layout4"]

#: positions a scale covers (along the reduction dim): a kernel step is 64 positions
GROUP_SIZES = (64, 128)
#: the grid's codes: LOW..HIGH
LOW, HIGH = -8, 7


def _check_group(group: int, in_features: int) -> None:
    if group not in GROUP_SIZES:
        raise ValueError(f"int4 values: group={group!r} is not supported; a scale covers {GROUP_SIZES[0]} or "
                         f"{GROUP_SIZES[1]} positions of a row")
    if in_features % group:
        raise ValueError(f"int4 values: in_features {in_features} is not a multiple of group={group}")


def group_scales(kept: Tensor, group: int) -> Tensor:
    """fp16 ``[rows, K / group]`` of a row-major ``[rows, K / 2]`` tensor of kept values (any float dtype): each
    group's value of largest magnitude over -8, rounded to fp16. NaN or infinite values, and scales past fp16's
    range, are refused."""
    rows, half = kept.shape
    flat = kept.float()
    if not bool(torch.isfinite(flat).all()):
        bad = (~torch.isfinite(flat)).any(1).nonzero().flatten()[:8].tolist()
        raise ValueError(f"int4 values: rows {bad} hold NaN or infinite weights, which no int4 grid holds; fix the "
                         "weights (or keep this layer at its float dtype)")
    groups = flat.view(rows, half * 2 // group, group // 2)
    top = groups.gather(2, groups.abs().argmax(2, keepdim=True)).squeeze(2)
    scales = (top / LOW).to(torch.float16)
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"int4 values: a weight of magnitude {float(flat.abs().max()):.3g} needs a scale past "
                         "fp16's range (65504 * 8); keep this layer at its float dtype")
    return scales


def quantize_layout4(values: Tensor, out_features: int, group: int) -> tuple[Tensor, Tensor]:
    """``(codes, scales)`` of the CPU layout's ``values`` ``[groups, K/16, GROUP, 8]`` (any float dtype): uint8
    ``[groups, K/64, GROUP/2, 32]`` (two rows' codes a byte, see the module doc) and fp16 scales ``[groups,
    K/group, GROUP]``; the layout's padding rows (past ``out_features``) stay zeros."""
    ngroups, words, rows_g, eight = values.shape
    k = words * 16
    _check_group(group, k)
    kept = values.permute(0, 2, 1, 3).reshape(ngroups * rows_g, words * eight)  # row-major kept values
    scales = group_scales(kept, group)  # [rows, K / group]
    d = scales.float().repeat_interleave(group // 2, dim=1)
    codes = torch.where(d != 0, torch.round(kept.float() / torch.where(d != 0, d, 1.0)), 0.0).clamp_(LOW, HIGH)
    nib = (codes + 8).to(torch.uint8)  # [rows, K/2]
    # [groups, rows, steps, 32] (a step's 32 kept values in word order) -> pairs of rows
    nib = nib.view(ngroups, rows_g // 2, 2, k // 64, 32).permute(0, 3, 1, 2, 4)
    packed = (nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).contiguous()
    return packed, scales.view(ngroups, rows_g, k // group).transpose(1, 2).contiguous()


def dequantize_layout4(codes: Tensor, scales: Tensor, group: int) -> Tensor:
    """fp32 values in the CPU layout ``[groups, K/16, GROUP, 8]`` (``code * scale``) of
    :func:`quantize_layout4`'s ``codes`` and ``scales``: the float layout :func:`~nmcompile.kernels.cpu24.unpack`
    reads."""
    ngroups, steps, pairs, _ = codes.shape
    k = steps * 64
    nib = torch.stack([codes & 0x0F, codes >> 4], dim=3)  # [groups, steps, pairs, 2, 32]
    kept = (nib.permute(0, 2, 3, 1, 4).reshape(ngroups, 2 * pairs, k // 2).float() - 8)
    d = scales.transpose(1, 2).float().repeat_interleave(group // 2, dim=2)  # [groups, rows, K/2]
    return (kept * d).view(ngroups, 2 * pairs, k // 16, 8).transpose(1, 2).contiguous()
