"""Pure N:M mask math on tensors: no state, no modules, traceable by Inductor as plain aten ops.

Every function groups ``m`` consecutive elements along ``dim`` (see :mod:`nmcompile.pattern`).
Ties in magnitude go to the lower index, so a hard mask keeps exactly ``n`` of every ``m``,
also in all-zero groups.
"""

from __future__ import annotations

import torch

__all__ = [
    "keep_mask",
    "prune",
    "soft_threshold",
    "soft_threshold_scale",
    "count_violations",
]


def _grouped(w: torch.Tensor, m: int, dim: int) -> torch.Tensor:
    """View ``w`` as ``[..., groups, m]`` with the groups taken along ``dim``."""
    return w.movedim(dim, -1).unflatten(-1, (-1, m))


def _ungrouped(g: torch.Tensor, dim: int) -> torch.Tensor:
    return g.flatten(-2).movedim(-1, dim)


def _rank(a: torch.Tensor) -> torch.Tensor:
    """Rank of each entry of ``a[..., m]`` by descending magnitude within its group (0 = largest).

    Entry j beats entry i if ``a_j > a_i``, or ``a_j == a_i`` and ``j < i``.
    """
    m = a.shape[-1]
    idx = torch.arange(m, device=a.device)
    earlier = idx.unsqueeze(0) < idx.unsqueeze(1)  # [i, j]: j < i
    ai, aj = a.unsqueeze(-1), a.unsqueeze(-2)
    beats = torch.where(earlier, aj >= ai, aj > ai)
    return beats.sum(-1, dtype=torch.int32)


def keep_mask(w: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """Boolean mask keeping the ``n`` largest-magnitude entries of every ``m`` along ``dim``."""
    rank = _rank(_grouped(w.abs(), m, dim))
    return _ungrouped(rank < n, dim)


def prune(w: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """``w`` with all but the top-``n`` magnitudes of every ``m`` set to zero."""
    g = _grouped(w, m, dim)
    rank = _rank(g.abs())
    return _ungrouped(torch.where(rank < n, g, torch.zeros_like(g)), dim)


def soft_threshold(w: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """S(w): shrink every entry by its group's (n+1)-th largest magnitude t, clamp at zero.

    ``S(w)_i = sign(w_i) * max(|w_i| - t, 0)``. At most ``n`` entries per group stay non-zero, and
    S is continuous in ``w`` (an entry reaches zero before it can leave the kept set).
    """
    g = _grouped(w, m, dim)
    a = g.abs()
    rank = _rank(a)
    t = torch.where(rank == n, a, torch.zeros_like(a)).sum(-1, keepdim=True)
    return _ungrouped(torch.sign(g) * torch.clamp(a - t, min=0), dim)


def soft_threshold_scale(w: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """The least-squares scale beta = <W, S(W)> / <S(W), S(W)> as a 0-d float32 tensor."""
    w32 = w.detach().float()
    s = soft_threshold(w32, n, m, dim)
    ss = (s * s).sum()
    # an all-zero S (e.g. a zero weight) has no best scale; 1 leaves S unchanged
    return torch.where(ss > 0, (w32 * s).sum() / ss.clamp_min(torch.finfo(torch.float32).tiny), 1.0)


def count_violations(t: torch.Tensor, n: int, m: int, dim: int = -1) -> tuple[int, int]:
    """``(groups with more than n non-zeros, total groups)`` of ``t`` along ``dim``."""
    nonzero = _grouped(t.detach() != 0, m, dim).sum(-1)
    return int((nonzero > n).sum()), nonzero.numel()
