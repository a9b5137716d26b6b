"""Column permutations that keep more magnitude under N:M pruning (pure tensor math, no modules).

A weight's N:M groups are ``m`` consecutive channels along its reduction dim. Which channels share
a group is arbitrary as long as the layer feeding those channels is permuted the same way (see
:mod:`nmcompile.permute.channels`), so a good permutation puts channels whose large entries sit
in different rows into the same group, and top-n of m then drops less. This is the channel
permutation idea of Pool & Yu, "Channel Permutations for N:M Sparsity" (NeurIPS 2021).

Here ``matrix`` is 2-D ``(rows, C)``: the C columns are the channels, grouped ``m`` at a time along
the last dim, and kept magnitude is ``sum(|w| * keep_mask(w, n, m, -1))``.

Search (:func:`search_permutation`)
-----------------------------------
1. Start from the identity; also try dealing the columns out by L1 norm (the i-th largest goes
   to group ``i % G``) and keep that only if it keeps more.
2. Score single-column swaps between two groups exactly. For slot ``p`` (a position in a group)
   let ``t_p[r]`` be the n-th largest magnitude among the group's *other* m-1 columns in row r
   and ``s_p[r]`` the sum of their top n. With column ``c`` in slot ``p`` the group keeps
   ``sum_r s_p[r] + relu(|w[r, c]| - t_p[r])``, and ``relu(x) = (x + |x|) / 2`` turns the sum over
   rows into column sums plus an L1 distance, so one ``torch.cdist(p=1)`` scores every slot
   against every column. Swapping slots p and q changes the kept magnitude by the sum of the two
   groups' changes (float64 throughout).
3. Each round takes, per pair of groups, the best of its m*m swaps and matches groups in
   disjoint pairs (a pair is taken where both groups rank each other first; with distinct gains
   this equals taking the largest gains greedily). Only improving swaps are applied, and as no
   group is in two swaps their gains add up exactly, so every round keeps strictly more.
4. Small matrices (``C * C * rows <= 2**27`` and ``C <= 1024``, e.g. 512 x 512) search all
   groups together, rescore only the groups a round changed, and stop when no swap gains or
   after ``max_rounds`` rounds; the result does not depend on ``seed``. Larger ones search in
   blocks: every round shuffles the groups (``torch.Generator`` seeded with ``seed``) into
   blocks of 16, scores all swaps inside all blocks in one batched ``cdist`` and applies the
   matched ones; it stops after 3 rounds in a row without gain or ``max_rounds`` rounds.

Bound on the work: ``max_evals`` work units in all (default ``2**32``; a unit is one
``| |w[r, c]| - t_p[r] |`` term, and each slot's statistics count 32 units per row), checked after
every round, so one round more than the budget can run: a round costs about
``C * rows * (C + 32)`` units when all groups are searched together (at most ``2**27`` plus the
statistics) and ``C * rows * (16 m + 32)`` in blocks. ``time_limit`` (seconds) is checked at the
same points. An unloaded 2-core CPU does about 1e9 units a second: 512 x 512 at 2:4 converges in
about 0.5 s, 2048 x 2048 stops at the default budget after about 3 s. The result is compared with
the identity at the end, and the identity is returned unless the permutation keeps strictly more.
"""

from __future__ import annotations

import math
import time

import torch

from .topn import keep_mask

__all__ = ["search_permutation", "kept_magnitude"]

_FULL_EVALS = 2**27  # search all groups together when C * C * rows is at most this
_FULL_CHANNELS = 1024  # ... and C at most this (the score table is C x C)
_BLOCK_GROUPS = 16  # groups per block otherwise
_STATS_COST = 32  # work units per row for one slot's statistics (one unit ~ one |x - t| term)
_DEFAULT_MAX_EVALS = 2**32
_PATIENCE = 3  # blocked rounds in a row without gain before giving up


def _block_groups(rows: int, channels: int, m: int) -> int:
    """Groups per search block for a ``(rows, channels)`` matrix (all of them when it fits)."""
    groups = channels // m
    if channels * channels * rows <= _FULL_EVALS and channels <= _FULL_CHANNELS:
        return groups
    return min(groups, _BLOCK_GROUPS)


def _check(matrix: torch.Tensor, n: int, m: int) -> None:
    if matrix.dim() != 2:
        raise ValueError(f"expected a 2-D (rows, channels) matrix, got shape {tuple(matrix.shape)}")
    if not (0 <= n <= m) or m < 1:
        raise ValueError(f"need 0 <= n <= m and m >= 1, got {n}:{m}")
    if matrix.shape[1] % m:
        raise ValueError(f"{matrix.shape[1]} channels are not a multiple of m={m}")


def kept_magnitude(matrix: torch.Tensor, n: int, m: int) -> float:
    """Sum of ``|w|`` that top-n of m keeps along the last dim of a 2-D matrix (as float64)."""
    _check(matrix, n, m)
    a = matrix.detach().to(torch.float64).abs()
    return float((a * keep_mask(a, n, m, -1)).sum())


def _kept(a: torch.Tensor, n: int, m: int) -> float:
    # a: non-negative float64 (rows, C); the same sum as kept_magnitude, without the checks
    if a.numel() == 0:
        return 0.0
    return float(a.unflatten(-1, (-1, m)).topk(n, dim=-1).values.sum())


def _slot_stats(p: torch.Tensor, n: int, m: int):
    """For the slots of ``p`` (rows, k*m): per-slot sums ``s`` (k*m,), thresholds ``t``
    (rows, k*m) of the group's other m-1 columns, and each group's kept magnitude (k,).

    With the group's sorted values ``v_1 >= ... >= v_{n+1}``: removing a kept entry ``x`` leaves
    top-n sum ``sum_n - x + v_{n+1}`` and n-th largest ``v_{n+1}``; removing a dropped one leaves
    ``sum_n`` and ``v_n``.
    """
    rows, width = p.shape
    g = p.view(rows, width // m, m)
    top, idx = g.topk(n + 1, dim=-1)
    kept_rows = top[..., :n].sum(-1, keepdim=True)  # (rows, k, 1)
    in_top = torch.zeros(g.shape, dtype=torch.bool).scatter_(-1, idx[..., :n], True)
    v_n, v_next = top[..., n - 1 : n], top[..., n : n + 1]
    t = torch.where(in_top, v_next, v_n)
    kept = kept_rows.sum(0).squeeze(-1)  # (k,)
    s = kept.repeat_interleave(m) - torch.where(in_top, g - v_next, 0.0).sum(0).flatten()
    return s, t.view(rows, width), kept


def _score_rows(t_slots: torch.Tensor, a_cols_t: torch.Tensor, a_colsum: torch.Tensor) -> torch.Tensor:
    """``sum_r relu(a[r, c] - t[r, p])`` for all slots p (rows of the result) and columns c."""
    l1 = torch.cdist(t_slots.t().contiguous().unsqueeze(0), a_cols_t.unsqueeze(0), p=1)[0]
    return 0.5 * (a_colsum.unsqueeze(0) - t_slots.sum(0).unsqueeze(1) + l1)


class _Budget:
    def __init__(self, max_evals: float, deadline: float | None):
        self.left = max_evals
        self.deadline = deadline

    def spend(self, evals: int) -> None:
        self.left -= evals

    def out(self) -> bool:
        return self.left <= 0 or (self.deadline is not None and time.monotonic() >= self.deadline)


def _match(best: torch.Tensor, tol: float) -> torch.Tensor:
    """Disjoint pairs of groups from per-pair gains ``best`` (blocks, k, k), symmetric.

    Returns each group's partner (-1 for none). Pairs are taken where both groups rank each other
    first (ties to the lower index) and the gain exceeds ``tol``, then again among the rest; with
    distinct gains this is the same matching as taking the largest gains greedily.
    """
    val = best.masked_fill(~(best > tol), -math.inf)
    k = best.shape[-1]
    ar = torch.arange(k)
    partner = torch.full(best.shape[:-1], -1, dtype=torch.long)
    while True:
        top, pick = val.max(-1)
        mutual = (top > -math.inf) & (pick.gather(-1, pick) == ar)
        if not bool(mutual.any()):
            return partner
        partner = torch.where(mutual, pick, partner)
        val = val.masked_fill(mutual.unsqueeze(-1) | mutual.unsqueeze(-2), -math.inf)


def _pair_gains(d: torch.Tensor, k: int, m: int):
    """Best swap per pair of groups from ``d`` (blocks, k*m, k*m), where ``d[b, p, q]`` is the
    gain in group(p) of moving the column at slot q into slot p: (best gain, argmax i*m + j)."""
    nb = d.shape[0]
    gain = (d + d.transpose(1, 2)).view(nb, k, m, k, m)
    best_j, j = gain.max(-1)  # (nb, k, m, k): best column j of group h for slot i of group g
    best, i = best_j.max(2)  # (nb, k, k)
    j = j.gather(2, i.unsqueeze(2)).squeeze(2)
    return best, i * m + j


def _swap(perm: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    tmp = perm[p].clone()
    perm[p] = perm[q]
    perm[q] = tmp


def _full_search(a: torch.Tensor, n: int, m: int, max_rounds: int, tol: float, budget: _Budget):
    """Swap rounds over all groups of ``a`` (rows, k*m), rescoring only the groups that changed.

    Returns the permutation of ``a``'s columns it reached.
    """
    rows, width = a.shape
    k = width // m
    perm = torch.arange(width)
    a_t = a.t().contiguous()  # (columns, rows), indexed by column id
    a_colsum = a.sum(0)
    s, t, kept = _slot_stats(a, n, m)
    # d[p, c]: change of group(p)'s kept magnitude when column c takes slot p
    d = _score_rows(t, a_t, a_colsum) + (s - kept.repeat_interleave(m)).unsqueeze(1)
    budget.spend(width * (width + _STATS_COST) * rows)
    same = torch.eye(k, dtype=torch.bool)
    ar = torch.arange(k)
    for _ in range(max_rounds):
        best, arg = _pair_gains(d[:, perm].unsqueeze(0), k, m)
        partner = _match(best.masked_fill(same, -math.inf), tol)[0]
        g = (partner > ar).nonzero().squeeze(1)
        if g.numel() == 0:
            break
        h = partner[g]
        ij = arg[0, g, h]
        _swap(perm, g * m + ij // m, h * m + ij % m)
        changed = torch.cat([g, h])
        slots = (changed.unsqueeze(1) * m + torch.arange(m)).flatten()
        s_c, t_c, kept_c = _slot_stats(a[:, perm[slots]], n, m)
        d[slots] = _score_rows(t_c, a_t, a_colsum) + (s_c - kept_c.repeat_interleave(m)).unsqueeze(1)
        budget.spend(len(slots) * (width + _STATS_COST) * rows)
        if budget.out():
            break
    return perm


def _blocked_round(a: torch.Tensor, perm: torch.Tensor, n: int, m: int, block: int, gen, tol: float,
                   budget: _Budget) -> float:
    """One round on random blocks of about ``block`` groups: score every swap inside each block,
    apply the matched ones to ``perm`` in place and return the gain."""
    rows, c = a.shape
    groups = c // m
    nb = math.ceil(groups / block)
    k = math.ceil(groups / nb)
    order = torch.randperm(groups, generator=gen)
    grp = torch.cat([order, torch.full((nb * k - groups,), -1, dtype=torch.long)]).view(nb, k)
    valid = grp >= 0  # the last block may be padded with empty groups
    slots = (grp.clamp_min(0).unsqueeze(-1) * m + torch.arange(m)).view(nb, k, m)
    x = a[:, perm[slots.flatten()]] * valid.repeat_interleave(m, dim=1).flatten()
    s, t, kept = _slot_stats(x, n, m)
    width = k * m
    x_t = x.t().contiguous().view(nb, width, rows)
    t_t = t.t().contiguous().view(nb, width, rows)
    l1 = torch.cdist(t_t, x_t, p=1)
    d = 0.5 * (x_t.sum(-1).unsqueeze(1) - t_t.sum(-1).unsqueeze(2) + l1)
    d += (s - kept.repeat_interleave(m)).view(nb, width, 1)
    budget.spend(nb * width * (width + _STATS_COST) * rows)
    best, arg = _pair_gains(d, k, m)
    off = torch.eye(k, dtype=torch.bool) | ~valid.unsqueeze(-1) | ~valid.unsqueeze(-2)
    best = best.masked_fill(off, -math.inf)
    partner = _match(best, tol)
    b, g = (partner > torch.arange(k)).nonzero(as_tuple=True)
    if g.numel() == 0:
        return 0.0
    h = partner[b, g]
    ij = arg[b, g, h]
    _swap(perm, slots[b, g, ij // m], slots[b, h, ij % m])
    return float(best[b, g, h].sum())


def _strided_start(a: torch.Tensor, m: int) -> torch.Tensor:
    """The i-th largest column (by L1 norm) goes to group i % G, so large columns spread out."""
    c = a.shape[1]
    groups = c // m
    order = torch.sort(a.sum(0), descending=True, stable=True).indices
    rank = torch.arange(c)
    slot = (rank % groups) * m + rank // groups
    perm = torch.empty(c, dtype=torch.long)
    perm[slot] = order
    return perm


def search_permutation(
    matrix: torch.Tensor,
    n: int,
    m: int,
    *,
    seed: int = 0,
    max_rounds: int = 100,
    time_limit: float | None = None,
    max_evals: float = _DEFAULT_MAX_EVALS,
) -> torch.Tensor:
    """A permutation ``perm`` of the columns of ``matrix`` (rows, C) with
    ``kept_magnitude(matrix[:, perm], n, m) >= kept_magnitude(matrix, n, m)``.

    Returns a CPU ``LongTensor``; the identity when ``C <= m``, ``n`` is 0 or ``m``, or no swap
    helps. Deterministic for a given ``seed`` (unless ``time_limit`` cuts the search short); see
    the module docstring for the algorithm and the bounds set by ``max_rounds``, ``time_limit``
    (seconds) and ``max_evals``.
    """
    _check(matrix, n, m)
    rows, c = matrix.shape
    identity = torch.arange(c)
    if c <= m or n in (0, m) or rows == 0:
        return identity
    deadline = None if time_limit is None else time.monotonic() + time_limit
    budget = _Budget(max_evals, deadline)
    a = matrix.detach().to(device="cpu", dtype=torch.float64).abs().contiguous()
    if not torch.isfinite(a).all():
        return identity
    base = _kept(a, n, m)
    tol = 1e-12 * float(a.sum())
    if tol == 0.0:
        return identity  # all zero

    perm = identity.clone()
    start = _strided_start(a, m)
    if _kept(a[:, start], n, m) > base + tol:
        perm = start

    groups = c // m
    block = _block_groups(rows, c, m)
    if block >= groups:
        perm = perm[_full_search(a[:, perm], n, m, max_rounds, tol, budget)]
    else:
        gen = torch.Generator().manual_seed(seed)
        idle = 0
        for _ in range(max_rounds):
            idle = idle + 1 if _blocked_round(a, perm, n, m, block, gen, tol, budget) <= tol else 0
            if idle >= _PATIENCE or budget.out():
                break

    if _kept(a[:, perm], n, m) > base:
        return perm
    return identity
