"""Top-N of M: hard masks, pruning and S-STE's soft threshold, written for Inductor to fuse.

Every function groups ``m`` consecutive elements along ``dim`` (see :mod:`nmcompile.pattern`).
Ties in magnitude go to the lower index, so a hard mask keeps exactly ``n`` of every ``m``,
also in all-zero groups.

The 2:4 forms are written for Inductor's CPU vectorizer: each element reads the other three of
its group through shifted contiguous slices ``w[..., 4+d : I-4+d]`` (d = -3..3), so vector lanes
run *across* groups, and its position in the group comes from two float pattern constants
compared with zero (bool constants and ``index % 4`` both fall back to scalar code). The first
and last group of each row, which would need reads outside the row, take the general form; the
three pieces are joined by ``cat``, which Inductor writes in place. On one 2-core CPU this made a
2:4 training step cost 1.04-1.08x a dense one, against 1.2-1.7x for a rank tensor over the
group dimension (see docs/benchmarks.md).

Groups along a dimension that is not the last (a linear weight's ``out`` axis, a conv's input
channels) are m contiguous runs of the following elements: each member is compared run against
run, with "beaten by at least n others" written in ``&``/``|`` (0.25 ms for a 1024 x 1024 2:4 prune
along ``out`` on the same CPU, against 0.82 ms through a transposed view).

Groups larger than :data:`PAIRWISE_MAX_M` are sorted (stable, so ties still go to the lower index)
instead of compared pair by pair, which keeps memory linear in the weight for any M.
"""

from __future__ import annotations

import torch

from ..pattern import is_stacked, layer_axes

__all__ = ["keep_mask", "prune", "prune_row_groups", "soft_threshold", "soft_threshold_scale", "count_violations"]


_BITS = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float16: (torch.int16, 0x7FFF),
         torch.bfloat16: (torch.int16, 0x7FFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}


def _magnitude(w: torch.Tensor) -> torch.Tensor:
    """A key that orders like ``|w|`` and ranks NaN above every magnitude, so a NaN weight never breaks
    the N:M count: it is kept (and reaches the output, as in dense training) and exactly N stay per group.

    For IEEE floats, the bits of ``|w|`` read as an integer order like ``|w|``, with inf above every
    finite value and NaN above inf; clearing the sign bit costs what ``abs`` costs.
    """
    bits = _BITS.get(w.dtype)
    if bits is None:
        return w.abs()
    int_type, magnitude_bits = bits
    return w.view(int_type) & magnitude_bits


def _grouped(w: torch.Tensor, m: int) -> torch.Tensor:
    return w.unflatten(-1, (-1, m))


#: the largest M whose masks compare every pair of a group's members (an [..., M, M] intermediate,
#: M times the weight's size in eager mode, fused away by Inductor); larger groups sort, which
#: needs memory linear in the weight for any M (a 1:4096 mask of a 4 MB weight would otherwise
#: take 4 GB)
PAIRWISE_MAX_M = 16


def _rank_keep(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep mask over the last dim: rank (0 = largest |w|, ties to the lower index) below n."""
    a = _grouped(_magnitude(w), m)
    if m > PAIRWISE_MAX_M:  # a stable descending sort puts equal keys in index order: ties as below
        top = torch.sort(a, dim=-1, descending=True, stable=True).indices[..., :n]
        return torch.zeros(a.shape, dtype=torch.bool, device=w.device).scatter(-1, top, True).flatten(-2)
    idx = torch.arange(m, device=w.device)
    earlier = idx.unsqueeze(0) < idx.unsqueeze(1)  # [i, j]: j < i
    ai, aj = a.unsqueeze(-1), a.unsqueeze(-2)
    rank = torch.where(earlier, aj >= ai, aj > ai).to(torch.int32).sum(-1)
    return (rank < n).flatten(-2)


def _threshold(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """The (n+1)-th largest |w| of each group, broadcast over the group (last dim).

    It is the smallest magnitude that at most n others exceed, which holds with ties too.
    """
    a = _grouped(w.abs(), m)  # values, not keys: the threshold is subtracted from |w|
    if m > PAIRWISE_MAX_M:  # the (n+1)-th of the sorted magnitudes; NaN in a group makes t NaN, as below
        t = torch.sort(a, dim=-1, descending=True).values[..., n : n + 1]
        t = torch.where(a.isnan().any(-1, keepdim=True), float("nan"), t)
        return t.expand(a.shape).flatten(-2)
    above = (a.unsqueeze(-2) > a.unsqueeze(-1)).to(torch.int32).sum(-1)
    t = torch.where(above <= n, a, torch.full_like(a, float("inf"))).amin(-1, keepdim=True)
    return t.expand(a.shape).flatten(-2)


def _shrink(w: torch.Tensor, t: torch.Tensor, scale) -> torch.Tensor:
    # sign(w) * max(|w| - t, 0), written so that it stays one fused pointwise expression
    out = w - torch.clamp(w, -t, t)
    return out if scale is None else scale * out


def _pattern(bits, repeats: int, device) -> torch.Tensor:
    return torch.tensor(bits * repeats, dtype=torch.float32, device=device) > 0


def _fast_2_4(w: torch.Tensor) -> bool:
    return w.shape[-1] >= 16


def _join_2_4(w: torch.Tensor, middle, edge) -> torch.Tensor:
    """``cat(edge(first group), middle(neighbour slices), edge(last group))`` along the last dim."""
    width = w.shape[-1]
    inner = width - 8

    def neighbour(d: int) -> torch.Tensor:  # |w| of the element d places away, always in bounds
        return w[..., 4 + d : width - 4 + d]

    odd = _pattern([0.0, 1.0, 0.0, 1.0], inner // 4, w.device)  # bit 0 of the position in group
    high = _pattern([0.0, 0.0, 1.0, 1.0], inner // 4, w.device)  # bit 1
    return torch.cat([edge(w[..., :4]), middle(neighbour, odd, high), edge(w[..., width - 4 :])], dim=-1)


def _partners(a, odd, high):
    """|w| of the elements at positions i^1, i^2, i^3 of each element's group."""
    p1 = torch.where(odd, a[-1], a[1])
    p2 = torch.where(high, a[-2], a[2])
    p3 = torch.where(high, torch.where(odd, a[-3], a[-1]), torch.where(odd, a[1], a[3]))
    return p1, p2, p3


def _dropped_n_4(neighbour, odd, high, n: int) -> torch.Tensor:
    """Whether each element of the middle slice is dropped by n:4: at least 4 - n others beat it."""
    a = {d: _magnitude(neighbour(d)) for d in range(-3, 4)}
    x = a[0]
    beats = {d: (a[d] >= x) if d < 0 else (a[d] > x) for d in (-3, -2, -1, 1, 2, 3)}
    c1, c2, c3 = _partners(beats, odd, high)
    if n == 1:
        return c1 | c2 | c3
    if n == 2:
        return (c1 & c2) | (c3 & (c1 | c2))
    return c1 & c2 & c3


def _keep_n_4(w: torch.Tensor, n: int) -> torch.Tensor:
    def middle(neighbour, odd, high):
        return ~_dropped_n_4(neighbour, odd, high, n)

    return _join_2_4(w, middle, lambda g: _rank_keep(g, n, 4))


def _gate(dropped: torch.Tensor, on: torch.Tensor | None) -> torch.Tensor:
    return dropped if on is None else dropped & on


def _prune_n_4(w: torch.Tensor, n: int, on: torch.Tensor | None) -> torch.Tensor:
    zero = torch.zeros((), dtype=w.dtype, device=w.device)

    def middle(neighbour, odd, high):  # the select inside each piece keeps the cat free for Inductor
        return torch.where(_gate(_dropped_n_4(neighbour, odd, high, n), on), zero, neighbour(0))

    return _join_2_4(w, middle, lambda g: torch.where(_gate(~_rank_keep(g, n, 4), on), zero, g))


def _soft_threshold_2_4(w: torch.Tensor, scale) -> torch.Tensor:
    def middle(neighbour, odd, high):
        a = {d: neighbour(d).abs() for d in range(-3, 4)}
        x = a[0]
        p1, p2, p3 = _partners(a, odd, high)
        low1, high1 = torch.minimum(x, p1), torch.maximum(x, p1)
        low2, high2 = torch.minimum(p2, p3), torch.maximum(p2, p3)
        third = torch.minimum(torch.maximum(low1, low2), torch.minimum(high1, high2))
        return _shrink(neighbour(0), third, scale)

    return _join_2_4(w, middle, lambda g: _shrink(g, _threshold(g, 2, 4), scale))


def at_least_levels(flags: list[torch.Tensor], k: int) -> list:
    """``levels[t - 1]``: where at least ``t`` of ``flags`` hold, for t = 1..k, in ``&``/``|`` only.

    ``flags`` are bool tensors (Inductor vectorises these ops) or int64 words of packed bits
    (:mod:`nmcompile.masks.bits`), where each bit counts on its own. A level that fewer than t
    flags can reach stays ``None``.
    """
    count: list = [None] * (k + 1)  # count[t]: at least t of the flags seen so far
    for b in flags:
        for t in range(k, 0, -1):
            if t > 1 and count[t - 1] is None:
                continue
            more = b if t == 1 else count[t - 1] & b
            count[t] = more if count[t] is None else count[t] | more
    return count[1:]


def _at_least(bools: list[torch.Tensor], k: int) -> torch.Tensor:
    """Whether at least ``k`` (>= 1) of ``bools`` hold."""
    return at_least_levels(bools, k)[k - 1]


def _across(w: torch.Tensor, m: int, dim: int) -> torch.Tensor | None:
    """``w`` as ``[..., groups, m, rest]`` when ``dim`` is followed by at least a vector of elements.

    Then the m members of a group are m contiguous runs ``rest`` apart, and the mask is computed
    run against run, lanes across ``rest`` (no transposed copy). None when that does not pay.
    """
    dim = dim % w.dim()
    rest = 1
    for size in w.shape[dim + 1 :]:
        rest *= size
    if dim == w.dim() - 1 or rest < 16 or m > 8:
        return None
    return w.reshape(*w.shape[:dim], w.shape[dim] // m, m, rest)


def _dropped_across(v: torch.Tensor, n: int, m: int) -> list[torch.Tensor]:
    """Per member of ``v``'s group axis (-2): whether at least n others beat it (ties: lower index)."""
    a = _magnitude(v).unbind(-2)
    return [
        _at_least([(a[k] >= a[j]) if k < j else (a[k] > a[j]) for k in range(m) if k != j], n)
        for j in range(m)
    ]


def keep_mask(w: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """Boolean mask keeping the ``n`` largest-magnitude entries of every ``m`` along ``dim``."""
    v = _across(w, m, dim)
    if v is not None and n < m:
        return torch.stack([~d for d in _dropped_across(v, n, m)], -2).reshape(w.shape)
    v = w.movedim(dim, -1)
    keep = _keep_n_4(v, n) if m == 4 and _fast_2_4(v) else _rank_keep(v, n, m)
    return keep.movedim(-1, dim)


def prune(w: torch.Tensor, n: int, m: int, dim: int = -1, on: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` with all but the top-``n`` magnitudes of every ``m`` set to zero.

    ``on``: a 0-d bool tensor; where it is False, ``w`` is returned unchanged. The switch sits in
    the same pass as the mask (a recipe that turns pruning on at run time costs no extra pass).
    """
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    v = _across(w, m, dim)
    if v is not None and n < m:
        dropped = _dropped_across(v, n, m)
        return torch.stack([torch.where(_gate(d, on), zero, v.select(-2, j)) for j, d in enumerate(dropped)], -2).reshape(w.shape)
    v = w.movedim(dim, -1)
    if m == 4 and _fast_2_4(v):
        out = _prune_n_4(v, n, on)
    else:
        out = torch.where(_gate(~_rank_keep(v, n, m), on), zero, v)
    return out.movedim(-1, dim)


def prune_row_groups(w: torch.Tensor, order: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """``w`` pruned n:m along axis 0, where the groups are runs of m rows in the order ``order``.

    Same result as pruning ``w[order]`` along axis 0 and putting the rows back (ties: the row
    earlier in ``order``), computed as a gather: each row reads the rows of its group and keeps
    itself or not, so Inductor writes every output row once, in place, without a permuted copy.
    """
    rows = order.shape[0]
    position = torch.empty_like(order).index_put((order,), torch.arange(rows, device=order.device))
    if m > PAIRWISE_MAX_M:  # the gather below keeps m row comparisons alive: m times the weight
        return prune(w.index_select(0, order), n, m, 0).index_select(0, position)
    members = order.view(-1, m)[position // m]  # [rows, m]: each row's group, in ``order``
    slot = (position % m).view(-1, *([1] * (w.dim() - 1)))  # each row's place in its group
    mine = _magnitude(w)
    beaten = []
    for j in range(m):
        other = _magnitude(w.index_select(0, members[:, j]))
        beaten.append((other > mine) | ((other == mine) & (slot > j)))  # j == slot: itself, never
    return torch.where(_at_least(beaten, n), torch.zeros((), dtype=w.dtype, device=w.device), w)


def soft_threshold(w: torch.Tensor, n: int, m: int, dim: int = -1, scale: torch.Tensor | None = None):
    """``scale * S(w)``: every entry shrunk by its group's (n+1)-th largest magnitude t.

    ``S(w)_i = sign(w_i) * max(|w_i| - t, 0)``. At most ``n`` entries per group stay non-zero, and
    S is continuous in ``w`` (an entry reaches zero before it can leave the kept set).
    """
    v = w.movedim(dim, -1)
    if (n, m) == (2, 4) and _fast_2_4(v):
        out = _soft_threshold_2_4(v, scale)
    else:
        out = _shrink(v, _threshold(v, n, m), scale)
    return out.movedim(-1, dim)


def soft_threshold_scale(w: torch.Tensor, n: int, m: int, dim: int = -1) -> torch.Tensor:
    """The least-squares scale beta = <W, S(W)> / <S(W), S(W)> per layer, float32.

    A 0-d tensor for one layer; for a stacked (expert) weight (``dim`` negative, three or more
    dims, see :mod:`nmcompile.pattern`) one scale per expert, shaped ``[E, 1, 1]`` to broadcast.
    """
    w32 = w.detach().float()
    s = soft_threshold(w32, n, m, dim)
    if is_stacked(w.dim(), dim):
        axes, keep = layer_axes(w.dim(), dim), True
    else:
        axes, keep = tuple(range(w.dim())), False
    ss = (s * s).sum(axes, keepdim=keep)
    # an all-zero S (e.g. a zero weight) has no best scale; 1 leaves S unchanged
    return torch.where(ss > 0, (w32 * s).sum(axes, keepdim=keep) / ss.clamp_min(torch.finfo(torch.float32).tiny), 1.0)


def count_violations(t: torch.Tensor, n: int, m: int, dim: int = -1) -> tuple[int, int]:
    """``(groups with more than n non-zeros, total groups)`` of ``t`` along ``dim``."""
    nonzero = _grouped((t.detach() != 0).movedim(dim, -1), m).sum(-1)
    return int((nonzero > n).sum()), nonzero.numel()


#: dtype of masks kept as recipe state. ``uint8`` rather than ``bool``: Inductor's CPU backend
#: vectorises a multiply by a ``uint8`` mask (0.13 ms for a 1024 x 1024 weight) but not a
#: ``where`` on a ``bool`` one (1.6 ms), measured on torch 2.13.
STORED_MASK_DTYPE = torch.uint8


def store_mask(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as a 0/1 ``uint8`` state tensor (see :data:`STORED_MASK_DTYPE`)."""
    return mask.to(STORED_MASK_DTYPE)


def apply_mask(weight: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """``weight`` with the entries a stored 0/1 mask drops set to zero (differentiable: the
    gradient is masked the same way). Finite weights only: a multiply keeps NaN and inf."""
    return weight * stored.to(weight.dtype)
