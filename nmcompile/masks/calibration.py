"""Calibration statistics of a weight's input, in the weight's column layout.

A weight is seen as a matrix ``[rows, cols]`` (per expert for stacked weights) whose N:M groups are
``m`` consecutive columns, and its GEMM as ``Y = X W^T`` with ``X`` of shape ``[tokens, cols]``:

==========================  ======  =================================================
weight                      dim     columns
==========================  ======  =================================================
``[out, in]`` (linear)      1       ``W``
``[in, out]`` (Conv1D, x@W) 0       ``W^T``
``[out, in, k...]`` (conv)  1       ``W`` with input channels moved last, flattened:
                                    columns ordered (kernel position, input channel),
                                    so each group is M channels at one kernel position
``[E, out, in]`` (experts)  -1      each ``W[e]``
``[E, in, out]`` (experts)  -2      each ``W[e]^T``
==========================  ======  =================================================

:func:`input_rows` turns the GEMM's input operand as the graph has it into ``X`` (unfolded patches
for a convolution) and says which expert each row reached; :func:`accumulate` adds ``X^T X`` (or
the per-column sum of squares) and the token count into the state tensors, per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["to_columns", "from_columns", "columns_shape", "input_rows", "accumulate", "zero_undefined", "LAYOUTS"]

#: how the GEMM reads its input operand ``x`` (see :func:`input_rows`)
LAYOUTS = ("rows", "t", "batched", "batched_t", "grouped", "gathered", "gathered_t", "conv")
ALL_EXPERTS = -2  # every expert sees every row (x [T, in] @ W [E, in, out] broadcasts)


def to_columns(w: torch.Tensor, dim: int) -> torch.Tensor:
    """``w`` as ``[..., rows, cols]`` with its N:M groups along the last axis (a view where possible)."""
    if dim < 0:  # stacked: each expert's matrix
        return w if dim == -1 else w.transpose(-2, -1)
    if w.dim() == 2:
        return w if dim == 1 else w.t()
    return w.movedim(1, -1).reshape(w.shape[0], -1)  # conv: (kernel position, input channel)


def from_columns(c: torch.Tensor, shape: torch.Size, dim: int) -> torch.Tensor:
    """The inverse of :func:`to_columns` for a weight of ``shape``."""
    if dim < 0:
        return c if dim == -1 else c.transpose(-2, -1)
    if len(shape) == 2:
        return c if dim == 1 else c.t()
    moved = (shape[0], *shape[2:], shape[1])
    return c.reshape(moved).movedim(-1, 1)


def columns_shape(shape, dim: int) -> tuple[tuple[int, ...], int]:
    """``(expert axes, cols)`` of a weight of ``shape`` (expert axes empty unless stacked)."""
    shape = tuple(shape)
    if dim < 0:
        return shape[:-2], shape[dim]
    if len(shape) == 2:
        return (), shape[dim]
    cols = 1
    for size in shape[1:]:
        cols *= size
    return (), cols


def input_rows(x: torch.Tensor, layout: str, route: torch.Tensor | None, conv: list[int]):
    """``(X [tokens, cols], who)``: the rows the GEMM multiplies by the weight, and the expert of each.

    ``who`` is None (one expert given by the caller, or no expert axis), :data:`ALL_EXPERTS`, or an
    int64 tensor of one expert index per row (rows routed nowhere carry -1).

    Layouts: ``rows`` ``x [..., cols]``; ``t`` ``x [..., cols, T]`` (``W @ x``); ``batched``
    ``x [E, T, cols]`` (or ``[T, cols]`` broadcast to every expert); ``batched_t`` ``x [E, cols, T]``;
    ``grouped`` ``x [S, cols]`` with ``route`` the cumulative row ends per expert (``offs``);
    ``gathered`` ``x [T, k, cols]`` with ``route`` one expert per ``T`` (``x @ W[ids]``), ``gathered_t``
    ``x [T, cols, k]`` (``W[ids] @ x``); ``conv``
    ``x [B, C, *spatial]`` with ``conv`` = kernel sizes, strides, paddings, dilations.
    """
    if layout == "rows":
        return x.reshape(-1, x.shape[-1]), None
    if layout == "t":
        return x.transpose(-2, -1).reshape(-1, x.shape[-2]), None
    if layout in ("batched", "batched_t"):
        if layout == "batched_t":
            x = x.transpose(-2, -1)
        if x.dim() == 2:
            return x, ALL_EXPERTS
        experts, tokens = x.shape[0], x.shape[1]
        who = torch.arange(experts, device=x.device).repeat_interleave(tokens)
        return x.reshape(-1, x.shape[-1]), who
    if layout == "grouped":
        ends = route.to(torch.int64)
        who = torch.bucketize(torch.arange(x.shape[0], device=x.device), ends, right=True)
        return x, torch.where(who < ends.numel(), who, -1)
    if layout in ("gathered", "gathered_t"):
        if layout == "gathered_t":
            x = x.transpose(-2, -1)
        k = x.shape[1] if x.dim() == 3 else 1
        return x.reshape(-1, x.shape[-1]), route.to(torch.int64).repeat_interleave(k)
    if layout == "conv":
        return _patches(x, conv), None
    raise ValueError(f"calibration layout {layout!r} is not one of {', '.join(LAYOUTS)}")


def _patches(x: torch.Tensor, conv: list[int]) -> torch.Tensor:
    """Unfolded conv input ``[B * L, k... * C]``, columns ordered (kernel position, channel)."""
    k = len(conv) // 4
    kernel, stride, padding, dilation = (conv[i * k:(i + 1) * k] for i in range(4))
    if k == 1:  # conv1d as a conv2d of height 1
        x = x.unsqueeze(2)
        kernel, stride, padding, dilation = [1, *kernel], [1, *stride], [0, *padding], [1, *dilation]
    channels = x.shape[1]
    cols = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)  # [B, C*K, L]
    batch, _, positions = cols.shape
    cols = cols.reshape(batch, channels, -1, positions).permute(0, 3, 2, 1)  # [B, L, K, C]
    return cols.reshape(batch * positions, -1)


def zero_undefined(stat: torch.Tensor, count: torch.Tensor) -> None:
    """Zero the statistics whose ``count`` is 0: they are undefined until their first rows (uninitialised
    when the recipe is declared, or released by :func:`nmcompile.oneshot.solve.reset`)."""
    fresh = count == 0
    if fresh.dim() == 0:
        if bool(fresh):
            stat.zero_()
    elif bool(fresh.any()):
        stat[fresh] = 0


def accumulate(stat: torch.Tensor, count: torch.Tensor, x: torch.Tensor, who, expert: int, gram: bool) -> None:
    """Add the rows ``x`` to ``stat`` (``X^T X`` if ``gram``, else the per-column sum of squares) and
    their number to ``count``, in float32 (``stat``'s dtype), per expert (see :func:`input_rows`).
    A negative ``count`` pauses the weight: nothing is added, ``stat`` is not touched (see
    :func:`nmcompile.oneshot.solve.solve_sequential`). Where ``count`` is 0, ``stat`` is undefined and
    is zeroed first."""
    lowest = int(count.min())
    if lowest < 0:
        return  # paused (sequential calibration gathers one block at a time)
    if lowest == 0:
        zero_undefined(stat, count)
    x = x.to(stat.dtype)
    if who is None:
        target, counter = (stat, count) if expert < 0 else (stat[expert], count[expert])
        target.add_(x.t() @ x if gram else x.square().sum(0))
        counter.add_(x.shape[0])
        return
    if isinstance(who, int):  # ALL_EXPERTS
        stat.add_(x.t() @ x if gram else x.square().sum(0))
        count.add_(x.shape[0])
        return
    routed = who >= 0
    x, who = x[routed], who[routed]
    count.index_add_(0, who, torch.ones_like(who, dtype=count.dtype))
    if not gram:
        stat.index_add_(0, who, x.square())
        return
    for e in torch.unique(who).tolist():
        rows = x[who == e]
        stat[e].add_(rows.t() @ rows)
