"""Unbiased N:M sparsification of neural gradients with the least variance (N = 1 or 2).

Reference: Chmiel, Hubara, Banner, Soudry, "Minimum variance unbiased N:M sparsity for the
neural gradients", ICLR 2023.

Every function groups ``m`` consecutive elements along ``dim`` (see :mod:`nmcompile.pattern`).
For one group ``x`` with magnitudes ``a_i = |x_i|`` and ``S = sum(a)``, element ``i`` is kept with
probability ``pi_i`` and, when kept, replaced by ``x_i / pi_i`` (all others become 0). That is
unbiased for any ``pi_i > 0`` on the non-zero entries, and the variance of the group,
``sum_i a_i^2 (1/pi_i - 1)``, depends on the marginals ``pi`` only. Its minimum subject to
``sum(pi) = N`` and ``0 <= pi_i <= 1`` is:

- N = 1: ``pi_i = a_i / S``; the one kept element becomes ``sign(x_i) * S``.
- N = 2, ``max(a) <= S/2``: ``pi_i = 2 a_i / S``; both kept elements become ``sign * S/2``.
- N = 2, ``max(a) > S/2``: the largest element is always kept, unchanged, and exactly one of
  the others is kept with ``pi_i = a_i / R`` (``R`` = sum of the others), becoming ``sign * R``.

Entries that are zero get ``pi = 0`` and are never kept, so a group with fewer than ``N``
non-zeros keeps all of them exactly, and an all-zero group stays zero.

Sampling uses one uniform ``U`` per group (systematic sampling): the ``pi`` of the group are
laid end to end and the elements whose interval holds one of ``U, U+1, ...`` are kept. That
gives exactly the marginals ``pi``. The element kept with certainty in the skewed N = 2 case is
taken out of the line first, so floating-point rounding can never drop it.

Everything is written with pointwise ops, sums and a running sum over the group, with no
data-dependent shapes or host syncs, so it traces under ``torch.compile(fullgraph=True)``
(it runs inside the backward of sparse linear layers, on every gradient).
"""

from __future__ import annotations

import torch

__all__ = ["inclusion_probabilities", "mvue", "mvue_variance"]


def _check(x: torch.Tensor, n: int, m: int, dim: int) -> None:
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (n, m))
    if not ints or n not in (1, 2) or m <= n:
        raise ValueError(
            f"MVUE sparsification supports N:M patterns with N in (1, 2) and M > N "
            f"(e.g. 1:2, 2:4, 2:8), got {n}:{m}"
        )
    if not x.is_floating_point():
        raise ValueError(f"MVUE sparsification needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("MVUE sparsification needs at least a 1-D tensor, got a 0-d tensor")
    size = x.size(dim)  # raises IndexError for a dim out of range
    if size % m:
        raise ValueError(
            f"MVUE {n}:{m} along dim {dim}: size {size} is not a multiple of M={m}; the token "
            f"(grouping) count must be a multiple of {m} (pad it to {size + (-size) % m})"
        )


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _grouped(x: torch.Tensor, m: int, dim: int) -> tuple[torch.Tensor, int, int]:
    """``(v, dim, ax)``: ``x`` in the compute dtype with ``dim`` split in place into ``[groups, m]``
    (group members along ``ax = dim + 1``), so the trailing (usually contiguous) axes stay
    innermost and the group sums run across rows rather than along strided columns."""
    dim = dim % x.dim()
    return x.unflatten(dim, (-1, m)).to(_compute_dtype(x)), dim, dim + 1


def _plan(a: torch.Tensor, n: int, ax: int):
    """For grouped magnitudes ``a`` (the ``m`` members of each group along axis ``ax``): ``(pi, h, sure)``.

    ``pi`` are the inclusion probabilities, ``h = a / pi`` the magnitude a kept element takes
    (any value where ``a = 0``), and ``sure`` marks the element kept with certainty in the skewed
    2:M case (None for N = 1).
    """
    total = a.sum(ax, keepdim=True)
    safe_total = torch.where(total > 0, total, 1.0)
    if n == 1:
        return a / safe_total, total.expand_as(a), None
    top = a.amax(ax, keepdim=True)
    # with two tied maxima the float sum is at least 2*top, so ``sure`` marks one element at most
    skewed = 2 * top > total
    sure = skewed & (a == top)
    # the others summed directly (not total - top), so a tiny remainder is not rounded away
    rest = torch.where(sure, 0.0, a).sum(ax, keepdim=True)
    safe_rest = torch.where(rest > 0, rest, 1.0)
    pi = torch.where(skewed, torch.where(sure, 1.0, a / safe_rest), 2 * a / safe_total)
    h = torch.where(skewed, torch.where(sure, a, rest), total / 2)
    return pi, h, sure


def _running_sum(p: torch.Tensor, ax: int) -> torch.Tensor:
    """``p.cumsum(ax)`` for a short axis, as adds Inductor fuses (its CPU backend calls aten's cumsum)."""
    total, out = None, []
    for part in p.unbind(ax):
        total = part if total is None else total + part
        out.append(total)
    return torch.stack(out, ax)


def _systematic(p: torch.Tensor, u: torch.Tensor, ax: int) -> torch.Tensor:
    """Keep mask with marginals ``p`` (each in [0, 1], integer group sum <= 2; groups along ``ax``),
    ``u`` one uniform per group (size 1 along ``ax``).

    An element is kept iff its interval ``[c_{i-1}, c_i)`` of the cumulative sum holds one of
    the points ``u, u+1, ...``. The count of points below ``c`` is ``ceil(c - u)``, monotone in
    ``c``, so the kept count telescopes to exactly the (rounded) group total, whatever the
    rounding, and an element with ``p = 0`` (equal neighbouring sums) is never kept.
    """
    c = _running_sum(p, ax)
    size = c.shape[ax]
    end = c.narrow(ax, size - 1, 1)
    count = torch.round(end)  # the exact group total: 0, 1 or 2
    # the last non-zero element (and the zeros after it, which stay empty) ends exactly at
    # ``count``, so a point just below the integer cannot fall off a slightly short total
    c = torch.where(c >= end, count, torch.minimum(c, count))
    # u <= 1 - eps keeps ``2 - u`` above 1 after rounding (enough for totals up to 2)
    u = u.to(p.dtype).clamp(0.0, 1.0 - torch.finfo(p.dtype).eps)
    below = torch.ceil(c - u)
    before = torch.cat([torch.zeros_like(below.narrow(ax, 0, 1)), below.narrow(ax, 0, size - 1)], ax)
    return below > before


def inclusion_probabilities(x: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """Probability that :func:`mvue` keeps each entry of ``x``; same shape as ``x``.

    Float32 for fp16/bf16 input, ``x``'s dtype otherwise. Each group sums to
    ``min(n, number of non-zeros in the group)``.
    """
    _check(x, n, m, dim)
    v, dim, ax = _grouped(x, m, dim)
    pi, _, _ = _plan(v.abs(), n, ax)
    return pi.flatten(dim, ax)


def mvue(x: torch.Tensor, n: int, m: int, dim: int = -1, *, u: torch.Tensor | None = None) -> torch.Tensor:
    """Unbiased minimum-variance N:M sparsification of ``x`` along ``dim`` (same shape and dtype).

    At most ``n`` entries of every ``m`` are non-zero and ``E[mvue(x)] = x``. ``u`` holds one
    uniform in [0, 1) per group, shaped ``x.movedim(dim, -1).shape[:-1] + (x.size(dim) // m,)``;
    without it they are drawn with ``torch.rand`` on ``x``'s device (seeded by
    ``torch.manual_seed``).
    """
    _check(x, n, m, dim)
    v, dim, ax = _grouped(x, m, dim)
    if u is None:
        u = torch.rand(v.shape[:ax] + (1,) + v.shape[ax + 1:], device=x.device)
    else:
        expected = v.shape[:dim] + v.shape[ax + 1:] + (v.shape[dim],)
        if tuple(u.shape) != tuple(expected):
            raise ValueError(
                f"u must hold one uniform per group, shape {tuple(expected)} "
                f"(x.movedim(dim, -1).shape[:-1] + (x.size(dim) // {m},)), got {tuple(u.shape)}"
            )
        u = u.movedim(-1, dim).unsqueeze(ax)
    a = v.abs()
    pi, h, sure = _plan(a, n, ax)
    if sure is None:
        keep = _systematic(pi, u, ax)
    else:
        keep = _systematic(torch.where(sure, 0.0, pi), u, ax) | sure
    out = torch.where(keep, torch.sign(v) * h, 0.0)
    return out.flatten(dim, ax).to(x.dtype)


def mvue_variance(x: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """Variance of :func:`mvue` summed over each group: ``sum_i a_i^2 (1/pi_i - 1)``.

    Shape ``x.movedim(dim, -1).shape[:-1] + (x.size(dim) // m,)``; float32 for fp16/bf16 input,
    ``x``'s dtype otherwise.
    """
    _check(x, n, m, dim)
    v, dim, ax = _grouped(x, m, dim)
    a = v.abs()
    _, h, _ = _plan(a, n, ax)
    # a^2 / pi - a^2 = a (h - a); entries with a = 0 add nothing
    return (a * (h - a)).sum(ax).movedim(dim, -1)
