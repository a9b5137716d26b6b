"""2:4 weights with int8 or 4-bit values: the grids their kept values are rounded to, and the kernel's layouts.

int8: each row's kept values rounded to a symmetric int8 grid with one scale.

A row's scale is its largest kept magnitude over 127 (levels -127..127; -128 is never used, so the grid is
symmetric and negating a weight negates its code), held in fp32 whatever the activation dtype: a bf16
scale would carry up to 0.4% of relative error into every product of its row, for 4 bytes a row (0.1% of
a 4096-wide int8 row's bytes). A row of zeros gets scale 1 (codes 0), never 0 or NaN. The kernel
multiplies the integer codes with fp32 activations, sums in fp32, and scales the row's sum once
(``nmsparse::cpu24_linear_q8``); on the ``avx2_a8`` route (``activations="int8"``) with the activations'
int8 codes, each block of 32 summed as integers and scaled by its block's scale first (``cpu24_a8.cpp``).
The ``-128``-free grid is what lets that route negate codes by sign (``vpsignb``) without overflow.

4-bit (:func:`quantize_layout4`; ``nmsparse::cpu24_linear_q4``, on the ``avx2_a8`` route only): each row's kept
values in groups along the reduction dim, a scale per group. A group covers ``group`` positions of a row (64 or 128: 32 or 64 kept values). Its scale ``d`` is the group's
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
registers, one ``and`` and one shift apart. The positions are an index (:func:`position_index`, 2 bits a kept
value, as many bytes as the position bits): the kernel makes a row's pairing control from it in three
instructions (from the bits: six, plus their spreading per step; against the int8 route in the same process a
layer went from 1.16-1.27x to 1.29-1.41x, 1 and 2 threads, Zen 3). The
scales are fp16 ``[groups, K / group, GROUP]``: a step reads its 8 rows' scales in one 16-byte load.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...masks.grids import GROUP_SIZES, HIGH4, LEVELS, LOW4, group_grid, on_group_grid, on_row_grid, row_grid

__all__ = ["LEVELS", "ON_GRID", "ON_GRID_BF16", "on_grid", "row_scales", "round_rows", "grid_codes", "quantize_layout", "quantize_dense",
           "dense_rows", "GROUP_SIZES", "LOW4", "HIGH4", "group_scales", "position_index", "quantize_layout4", "dense4",
           "quantize_dense4", "dense_rows4", "round_groups4",
           "to_codes"]


def row_scales(values: Tensor) -> Tensor:
    """fp32 ``[rows]``: each row's largest magnitude over :data:`LEVELS` (1 for a row of zeros). ``values``:
    ``[rows, ...]``, any float dtype; NaN or infinite values are refused (no grid holds them)."""
    flat = values.reshape(values.shape[0], -1).float()
    if not bool(torch.isfinite(flat).all()):
        rows = (~torch.isfinite(flat)).any(1).nonzero().flatten()[:8].tolist()
        raise ValueError(f"int8 values: rows {rows} hold NaN or infinite weights, which no int8 grid holds; "
                         "fix the weights (or keep this layer at its float dtype)")
    return row_grid(flat)


#: how far from its grid point (in steps) a value may lie and still be read as on it: a point ``k * s`` (``|k| <=
#: 127``) stored in fp16 is off by at most ``127 * 2**-11`` = 0.06 steps, in fp32 by none
ON_GRID = 0.3
#: the same for values stored in bf16, whose rounding (half an ulp: up to ``2**-8`` of the value) puts ``127 * s``
#: up to 0.496 steps off: still nearest to its own point, so the codes are recovered exactly, but a bf16 weight
#: changed by less than half a step is read as on the grid
ON_GRID_BF16 = 0.497


def on_grid(dtype: torch.dtype) -> float:
    """The steps a value stored in ``dtype`` may lie from its grid point: :data:`ON_GRID_BF16` or :data:`ON_GRID`."""
    return ON_GRID_BF16 if dtype == torch.bfloat16 else ON_GRID


def round_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """``(w on its rows' int8 grids, scales)``: each row of ``w [rows, cols]`` rounded to nearest on the grid of
    :func:`row_scales` (values stay float: the one-shot solves' ``bits=8`` result before it is packed)."""
    scales = row_scales(w)
    return on_row_grid(w, scales).to(w.dtype), scales


def grid_codes(values: Tensor, scales: Tensor) -> tuple[Tensor, int]:
    """``(int8 codes, values off the grid)`` of ``values`` on the grid of ``scales`` (broadcast against them): a
    value is off when it lies more than :func:`on_grid` steps of its dtype from its grid point or past -127..127
    steps."""
    steps = values.float() / scales
    codes = torch.round(steps)
    off = ((steps - codes).abs() > on_grid(values.dtype)) | (codes.abs() > LEVELS)
    return codes.clamp_(-LEVELS, LEVELS).to(torch.int8), int(off.sum())


def quantize_layout(values: Tensor, out_features: int, scales: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """``(codes, scales)`` of the kernel layout's ``values`` ``[groups, K/16, GROUP, 8]`` (any float dtype):
    int8 codes in the same layout (round to nearest, ties to even) and fp32 scales ``[out_features]``; the
    padding rows (past ``out_features``) are zeros and stay zeros. Given ``scales`` (a one-shot solve's grid),
    the codes on that grid, or None where some value is not within :data:`ON_GRID` steps of it (the weight was
    changed after the solve)."""
    groups, words, group, eight = values.shape
    given = scales is not None
    rows = values.permute(0, 2, 1, 3).reshape(groups * group, words * eight)  # row-major copy of the kept values
    if scales is None:
        scales = row_scales(rows)
    else:
        scales = torch.cat([scales.float(), scales.new_ones(groups * group - scales.shape[0], dtype=torch.float32)])
    codes, off = grid_codes(rows, scales[:, None])
    if given and off:
        return None
    codes = codes.reshape(groups, group, words, eight).permute(0, 2, 1, 3).contiguous()
    return codes, scales[:out_features].contiguous()


def quantize_dense(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(values, scales)`` of a dense ``[N, K]`` weight (``K`` a multiple of 16) as int8 rows in the kernel's
    dense layout ``[groups, K/16, GROUP, 16]`` (``N`` padded with zero rows to whole groups of ``GROUP``,
    as the 2:4 layout is; ``nmsparse::cpu24_dense_q8``) and fp32 scales ``[N]``."""
    from . import GROUP

    n, k = weight.shape
    if k % 16:
        raise ValueError(f"int8 rows: in_features {k} is not a multiple of 16")
    scales = row_scales(weight)
    codes = torch.round(weight.float() / scales[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    pad = -n % GROUP
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
    values = codes.reshape(-1, GROUP, k // 16, 16).transpose(1, 2).contiguous()
    return values, scales


def dense_rows(values: Tensor, out_features: int) -> Tensor:
    """The int8 codes ``[out_features, K]`` of :func:`quantize_dense`'s layout (a view where it can be)."""
    groups, words, group, sixteen = values.shape
    return values.permute(0, 2, 1, 3).reshape(groups * group, words * sixteen)[:out_features]



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
    scales = group_grid(flat, group // 2)
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"int4 values: a weight of magnitude {float(flat.abs().max()):.3g} needs a scale past "
                         "fp16's range (65504 * 8); keep this layer at its float dtype")
    return scales


def position_index(bits: Tensor) -> Tensor:
    """The 4-bit layout's index ``[groups, K/64, GROUP, 8]`` uint8 of the CPU layout's position ``bits`` ``[groups,
    K/16, GROUP]``: per row and step, byte ``j`` holds in bits ``2L, 2L + 1`` where kept value ``j`` of the step's
    word ``L`` lies in its group of 4 positions (the word's group ``j // 2``: two kept a group)."""
    groups, words, rows = bits.shape
    word = bits.to(torch.int32) & 0xFFFF
    kept = (word[..., None] >> torch.arange(16, dtype=torch.int32)) & 1  # [groups, words, rows, 16]
    positions = torch.where(kept.bool(), torch.arange(16), 16).sort(-1).values[..., :8]  # each word's 8, in order
    within = (positions % 4).to(torch.uint8).view(groups, words // 4, 4, rows, 8)  # [.., L, row, j]
    index = within[:, :, 0] | (within[:, :, 1] << 2) | (within[:, :, 2] << 4) | (within[:, :, 3] << 6)
    return index.contiguous()


def quantize_layout4(values: Tensor, bits: Tensor, out_features: int, group: int,
                     scales: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(codes, index, scales)`` of the CPU layout's ``values`` ``[groups, K/16, GROUP, 8]`` (any float dtype) and
    ``bits``: uint8 codes ``[groups, K/64, GROUP/2, 32]`` (two rows' a byte, see the module doc), the positions as
    :func:`position_index` and fp16 scales ``[groups, K/group, GROUP]``; the layout's padding rows (past
    ``out_features``) stay zeros. Given ``scales`` ``[out_features, K/group]`` (a one-shot solve's grid), the codes on
    it, or None where some value is not within :func:`on_grid` steps of it (the weight was changed since)."""
    ngroups, words, rows_g, eight = values.shape
    k = words * 16
    _check_group(group, k)
    kept = values.permute(0, 2, 1, 3).reshape(ngroups * rows_g, words * eight)  # row-major kept values
    given = scales is not None
    if given:
        scales = torch.cat([scales.to(torch.float16), scales.new_zeros(ngroups * rows_g - out_features, k // group,
                                                                        dtype=torch.float16)])
    else:
        scales = group_scales(kept, group)  # [rows, K / group]
    d = scales.float().repeat_interleave(group // 2, dim=1)
    steps = kept.float() / torch.where(d != 0, d, 1.0)
    codes = torch.where(d != 0, torch.round(steps), 0.0)
    if given and bool((((steps - codes).abs() > on_grid(values.dtype)) | (codes < LOW4) | (codes > HIGH4)
                       | ((d == 0) & (kept != 0))).any()):
        return None
    codes = codes.clamp_(LOW4, HIGH4)
    nib = (codes + 8).to(torch.uint8)  # [rows, K/2]
    # [groups, rows, steps, 32] (a step's 32 kept values in word order) -> pairs of rows
    nib = nib.view(ngroups, rows_g // 2, 2, k // 64, 32).permute(0, 3, 1, 2, 4)
    packed = (nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).contiguous()
    return packed, position_index(bits), scales.view(ngroups, rows_g, k // group).transpose(1, 2).contiguous()


def dense4(codes: Tensor, index: Tensor, scales: Tensor, group: int, out_features: int) -> Tensor:
    """The dense fp32 ``[out_features, K]`` weight (``code * scale`` at each kept position, zeros elsewhere) of
    :func:`quantize_layout4`'s ``codes``, ``index`` and ``scales``."""
    ngroups, steps, pairs, _ = codes.shape
    rows, k = 2 * pairs, steps * 64
    nib = torch.stack([codes & 0x0F, codes >> 4], dim=3)  # [groups, steps, pairs, 2, 32]
    kept = nib.permute(0, 2, 3, 1, 4).reshape(ngroups * rows, steps, 4, 8).float() - 8  # [row, step, word, j]
    d = scales.transpose(1, 2).reshape(ngroups * rows, k // group).float().repeat_interleave(group // 64, dim=1)
    within = (index.permute(0, 2, 1, 3).reshape(ngroups * rows, steps, 1, 8).to(torch.int64)
              >> (2 * torch.arange(4)).view(1, 1, 4, 1)) & 3  # [row, step, word, j]
    position = 4 * (torch.arange(8) // 2) + within
    dense = torch.zeros(ngroups * rows, steps, 4, 16)
    dense.scatter_(3, position, kept * d[:, :, None, None])
    return dense.view(ngroups * rows, k)[:out_features]


def _codes4(groups: Tensor, scales: Tensor) -> Tensor:
    """Offset codes (0..15, uint8) of ``groups`` ``[..., n]`` on the fp16 ``scales`` ``[...]`` (0 where a scale is 0)."""
    d = scales.float()[..., None]
    codes = torch.where(d != 0, torch.round(groups.float() / torch.where(d != 0, d, 1.0)), 0.0).clamp_(LOW4, HIGH4)
    return (codes + 8).to(torch.uint8)


def quantize_dense4(weight: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """``(values, scales)`` of a dense ``[N, K]`` weight as 4-bit rows (``nmsparse::cpu24_dense_q4``; the output head):
    the grid of :func:`group_scales` over every position, values uint8 ``[groups, K/64, GROUP, 32]`` (a row's step:
    the low nibbles its words 0 and 2 in position order, the high ones words 1 and 3), fp16 scales ``[groups,
    K/group, GROUP]``; ``N`` padded with zero rows to whole groups of ``GROUP``."""
    from . import GROUP

    n, k = weight.shape
    _check_group(group, k)
    rows = torch.cat([weight.float(), weight.new_zeros(-n % GROUP, k, dtype=torch.float32)])
    scales = group_scales(rows, 2 * group)  # every position kept: `group` values a scale
    codes = _codes4(rows.view(rows.shape[0], k // group, group), scales).view(rows.shape[0], k // 64, 4, 16)
    lo, hi = codes[:, :, [0, 2]].flatten(2), codes[:, :, [1, 3]].flatten(2)  # [rows, steps, 32]
    values = (lo | (hi << 4)).view(-1, GROUP, k // 64, 32).transpose(1, 2).contiguous()
    return values, scales.view(-1, GROUP, k // group).transpose(1, 2).contiguous()


def dense_rows4(values: Tensor, scales: Tensor, group: int, rows: Tensor | None = None) -> Tensor:
    """fp32 ``[len(rows), K]`` of :func:`quantize_dense4`'s layout: the rows ``rows`` (all where None), dequantized."""
    ngroups, steps, g, _ = values.shape
    k = steps * 64
    flat = values.transpose(1, 2).reshape(ngroups * g, steps, 32)
    d = scales.transpose(1, 2).reshape(ngroups * g, k // group)
    if rows is not None:
        flat, d = flat.index_select(0, rows), d.index_select(0, rows)
    lo, hi = (flat & 0x0F).view(-1, steps, 2, 16), (flat >> 4).view(-1, steps, 2, 16)
    codes = torch.stack([lo[:, :, 0], hi[:, :, 0], lo[:, :, 1], hi[:, :, 1]], 2).reshape(-1, k).float() - 8
    return codes * d.float().repeat_interleave(group, dim=1)


def round_groups4(w: Tensor, group: int) -> Tensor:
    """``w`` ``[rows, cols]`` (2:4 or dense) rounded to nearest on its 4-bit grids, per row and group of ``group``
    positions (the grid of :func:`group_scales`; zeros stay zeros), values in ``w``'s dtype: what
    ``pack_weights(bits=4)`` holds for a float weight, as a dense tensor."""
    rows, cols = w.shape
    _check_group(group, cols)
    return on_group_grid(w, group_scales(w, 2 * group)).to(w.dtype)  # every position as a kept value


def to_codes(weight, bits: int, isa: str, grid: Tensor | None = None, group: int = 64) -> tuple:
    """``(weight, how)``: a :class:`~nmcompile.kernels.cpu24.weight.PackedLinearWeight` with float values, its kept
    values as codes (a new weight), computing in its dtype on ``isa``: on ``grid`` (the scales a one-shot solve or a recipe with
    ``bits=`` recorded) where the values still lie on it, else rounded to nearest. ``bits=8``: int8 with a scale per row;
    ``bits=4``: 4-bit with an fp16 scale per row and ``group`` positions."""
    n = weight.weight_shape[0]
    if bits == 4:
        found = None if grid is None else quantize_layout4(weight.values, weight.bits, n, group, grid)
        how = f"the recorded 4-bit grid (groups of {group})"
        if found is None:
            how = f"rounded to nearest, 4-bit in groups of {group}" + ("" if grid is None else
                                                                       " (its values left the recorded grid)")
            found = quantize_layout4(weight.values, weight.bits, n, group)
        codes, index, scales = found
        return weight._with(values=codes, bits=index, scales=scales, isa=isa, dtype=weight.dtype), how
    found = None if grid is None or grid.dim() != 1 else quantize_layout(weight.values, n, grid)
    how = "the recorded int8 grid"
    if found is None:
        how = "rounded to nearest" if grid is None else \
            "rounded to nearest (its values left the recorded int8 grid since it was recorded)"
        found = quantize_layout(weight.values, n)
    codes, scales = found
    return weight._with(values=codes, scales=scales, isa=isa, dtype=weight.dtype), how
