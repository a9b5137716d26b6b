"""Transposable N:M masks: N kept in every row *and* every column of each M x M tile.

Reference: Hubara et al., "Accelerated Sparse Neural Training: A Provable and Efficient Method to
Find N:M Transposable Masks", NeurIPS 2021.

A mask is transposable N:M when, cutting axes 0 and 1 of the weight into M x M tiles, every tile
holds exactly N ones in each of its M rows and each of its M columns, so both ``W`` (grouped
along axis 1) and ``W.T`` (grouped along axis 0) are N:M and one mask serves the forward and the
backward GEMM. Trailing axes (conv kernel positions of an ``[out, in, kh, kw]`` weight) are a
batch: each kernel position's ``[out, in]`` matrix is tiled on its own.

Each solver keeps as much magnitude as it can, tile by tile (``sum |w| * mask``):

- ``"exact"``: an optimal mask. For M <= 4 (2:4, 1:4, 3:4, ...) every valid tile pattern is
  enumerated (90 for 2:4) and all tiles are scored against all patterns in one matmul; a 2:4 mask
  of at least ``FUSED_MIN_TILES`` tiles on the CPU that is refreshed periodically (``repeated``; a
  one-off mask skips the compile), takes the same choices from one kernel that Inductor compiles once per
  tile count (``fused_2_4``; about 1 ms, half of it that kernel,
  against 25 ms for a 1024 x 1024 weight on 2 cores, so a mask can follow the weights every few
  steps). For larger M, a max-weight bipartite b-matching per tile (rows and columns of degree
  N, each entry used at most once), solved by successive shortest paths as a min-cost flow, all
  tiles in lockstep.
- ``"greedy"``: visit a tile's entries by decreasing magnitude and take each one whose row and
  column both still have fewer than N, then repair the tiles where that gets stuck (see
  :func:`_greedy_tiles`). Keeps at least half of the optimum in every tile.
- ``"auto"``: ``"exact"`` where it is a table look-up (M <= 4, so 2:4), ``"greedy"`` otherwise.

Determinism: every choice between equal candidates goes to the lowest index (stable sorts, first
arg-min/arg-max), so a given input always gives the same mask. The exact solvers work on
magnitudes rounded to integer multiples of ``2**-40`` times the tile's largest magnitude and
score them in float64, where all their sums are exact: ties are true ties and CPU and CUDA agree.
That rounding can cost at most ``N*M * 2**-40`` of the tile's largest magnitude, far below what a
float32 sum of the kept weights can resolve. Greedy scores in float32. NaN magnitudes count as 0
and infinite ones as the largest float32.

These are eager functions for pruning and periodic mask updates; they loop in Python with
data-dependent exits and are not meant to be traced by ``torch.compile``.
"""

from __future__ import annotations

import operator

import torch

from .transposable_exact import MAX_TABLE_M, FUSED_MIN_TILES, chunks, exact_tiles, pattern_table, fused_2_4

__all__ = ["transposable_mask", "tile_counts", "is_transposable"]

_METHODS = ("auto", "exact", "greedy")

# tiles per chunk, so that the per-chunk work tensors stay around tens of MB
_GREEDY_ELEMS = 1 << 21
_REPAIR_ELEMS = 1 << 22


# ----------------------------------------------------------------------------- validation, tiling


def _check_nm(n, m) -> tuple[int, int]:
    values = []
    for name, value in (("n", n), ("m", m)):
        if isinstance(value, bool):
            raise TypeError(f"transposable N:M: {name} must be an int, got {value!r}")
        try:
            values.append(operator.index(value))
        except TypeError:
            raise TypeError(f"transposable N:M: {name} must be an int, got {value!r}") from None
    n, m = values
    if not 1 <= n < m:
        raise ValueError(
            f"invalid transposable N:M pattern {n}:{m}: need 1 <= N < M "
            "(N kept in every row and column of each M x M tile), e.g. 2:4 or 4:8"
        )
    return n, m


def _check_shape(t: torch.Tensor, m: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    shape = tuple(t.shape)
    if t.dim() < 2:
        raise ValueError(
            f"{what} of shape {shape} cannot be tiled into {m}x{m} blocks: "
            "transposable N:M needs at least 2 dims (axes 0 and 1 are tiled)"
        )
    if shape[0] % m or shape[1] % m:
        raise ValueError(
            f"{what} of shape {shape} cannot be tiled into {m}x{m} blocks: "
            f"axes 0 and 1 ({shape[0]} and {shape[1]}) must both be divisible by M={m}"
        )


def _tile_perm(ndim: int) -> list[int]:
    # [R/m, m, C/m, m, *rest] -> [R/m, C/m, *rest, m, m]
    return [0, 2, *range(4, ndim + 2), 1, 3]


def _to_tiles(x: torch.Tensor, m: int) -> torch.Tensor:
    """``[R, C, *rest]`` -> ``[tiles, m, m]``, each tile's rows along axis 0 of ``x``."""
    r, c, *rest = x.shape
    x = x.reshape(r // m, m, c // m, m, *rest).permute(_tile_perm(x.dim()))
    return x.reshape(-1, m, m)


def _from_tiles(t: torch.Tensor, shape: torch.Size, m: int) -> torch.Tensor:
    r, c, *rest = shape
    perm = _tile_perm(len(shape))
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return t.reshape(r // m, c // m, *rest, m, m).permute(inverse).reshape(shape)


def _magnitudes(w: torch.Tensor) -> torch.Tensor:
    a = w.detach().abs().float()
    big = torch.finfo(torch.float32).max
    return torch.nan_to_num(a, nan=0.0, posinf=big, neginf=big)


# ----------------------------------------------------------------------------- greedy


def _greedy_tiles(a: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy masks ``[T, m, m]``: at least half the optimal kept magnitude in every tile.

    1. Visit the entries by decreasing magnitude (equal ones in row-major order) and take each one
       whose row and column both hold fewer than n. This takes a maximal set, and it keeps at
       least half of the optimum: an entry of the optimal mask that was passed over met a full
       row or column whose n taken entries were all visited earlier, so are at least as large;
       give it to one of those that is not itself in the optimum (a full line has n taken
       entries and at most n optimal ones), each taken entry then answers for at most two passed
       ones (one per end), each no larger than it.

    2. Maximal is not always complete: in 2:4, rows 0-2 x columns 0-2 can take a 6-cycle and
       (3, 3) the last entry, leaving row 3 and column 3 with one each; all that row's other
       columns and that column's other rows are full. Stuck tiles are common on random weights
       (about 15% at 2:4, half at 4:8). They are repaired one unit at a time: for the first row
       i still short and any column j still short, turn on (i, x), turn off (y, x) and turn on
       (y, j), choosing (y, x, j) with the largest magnitude change (ties: first in row-major
       (y, x, j) order). Such a triple always exists: every short row and short column meet at
       a taken entry (neither line was ever full, so greedy accepted it, and a repair only turns
       off entries in rows that are not short), hence the columns x that row i lacks are full,
       each with n taken rows, and column j lacks m - count(j) > m - n rows, so some row y of
       column x is missing from column j. Each step fills one unit of row i and of column j and
       leaves every other count unchanged.

    3. A repair can drop a large entry, so the half-optimum bound is rechecked on repaired tiles
       against ``min(2 * kept before repair, sum of each row's n largest, same for columns)``,
       all upper bounds on the optimum; a tile that misses it (none on any weights tried so far)
       gets the exact mask instead.
    """
    t, m, _ = a.shape
    out = torch.empty(t, m, m, dtype=torch.bool, device=a.device)
    for s in chunks(t, _GREEDY_ELEMS // (m * m)):
        out[s] = _greedy_chunk(a[s], n)
    return out


def _greedy_chunk(a: torch.Tensor, n: int) -> torch.Tensor:
    t, m, _ = a.shape
    dev = a.device
    order = torch.sort(a.reshape(t, m * m), dim=1, descending=True, stable=True).indices
    # flat positions into the [t*m] row / column counters and the [t*m*m] mask; row k = k-th visit
    base = torch.arange(t, device=dev).unsqueeze(1) * m
    row_at = (base + order // m).t().contiguous()
    col_at = (base + order % m).t().contiguous()
    cell_at = (base * m + order).t().contiguous()
    row_used = torch.zeros(t * m, dtype=torch.int32, device=dev)
    col_used = torch.zeros(t * m, dtype=torch.int32, device=dev)
    keep = torch.zeros(t * m * m, dtype=torch.bool, device=dev)
    for k in range(m * m):
        r, c = row_at[k], col_at[k]
        # the first n visits always fit: no line can hold n entries before the n-th visit
        take = (row_used[r] < n) & (col_used[c] < n) if k >= n else torch.ones_like(r, dtype=torch.bool)
        step = take.to(torch.int32)
        row_used[r] += step  # one entry per tile per step: no index repeats
        col_used[c] += step
        keep[cell_at[k]] = take
    keep = keep.reshape(t, m, m)
    row_used, col_used = row_used.reshape(t, m), col_used.reshape(t, m)
    stuck = (row_used.sum(1) < n * m).nonzero().squeeze(1)
    if stuck.numel():
        sub_a = a[stuck]
        before = keep[stuck]
        fixed = torch.empty_like(before)
        for s in chunks(stuck.numel(), _REPAIR_ELEMS // (m * m)):
            fixed[s] = _repair(sub_a[s], before[s], row_used[stuck[s]], col_used[stuck[s]], n)
        # the half-optimum check; the exact solver answers for any tile that fails it
        a64 = sub_a.double()
        kept_before = (a64 * before).sum((1, 2))
        kept_after = (a64 * fixed).sum((1, 2))
        row_bound = a64.topk(n, dim=2).values.sum((1, 2))
        col_bound = a64.topk(n, dim=1).values.sum((1, 2))
        bound = torch.minimum(2 * kept_before, torch.minimum(row_bound, col_bound))
        weak = (2 * kept_after < bound).nonzero().squeeze(1)
        if weak.numel():
            fixed[weak] = exact_tiles(sub_a[weak], n)
        keep[stuck] = fixed
    return keep


def _repair(a, keep, row_used, col_used, n):
    """Complete maximal masks ``[T, m, m]`` one unit per step (see :func:`_greedy_tiles`)."""
    t, m, _ = a.shape
    keep, row_used, col_used = keep.clone(), row_used.clone(), col_used.clone()
    tiles = torch.arange(t, device=a.device)
    ninf = torch.tensor(float("-inf"), dtype=a.dtype, device=a.device)
    for _ in range(n * m):
        short_row = row_used < n
        need = short_row.any(1)
        if not bool(need.any()):
            break
        i = short_row.to(torch.int8).argmax(1)  # first short row
        # gain of (y, x, j) = |w_ix| - |w_yx| + |w_yj|; the best j depends on y only
        gain_yj = torch.where(~keep & (col_used < n).unsqueeze(1), a, ninf)  # turn (y, j) on
        best_j, j_of_y = gain_yj.max(2)  # first j on ties
        gain_x = torch.where(keep[tiles, i], ninf, a[tiles, i])  # turn (i, x) on
        gain = (gain_x.unsqueeze(1) + torch.where(keep, -a, ninf)) + best_j.unsqueeze(2)  # [t, y, x]
        best, yx = gain.reshape(t, -1).max(1)  # first (y, x) in row-major order on ties
        go = need & (best > ninf)  # a feasible triple always exists for a short tile
        y, x = yx // m, yx % m
        j = j_of_y.gather(1, y.unsqueeze(1)).squeeze(1)
        keep[tiles, i, x] |= go
        keep[tiles, y, x] &= ~go
        keep[tiles, y, j] |= go
        row_used[tiles, i] += go.to(row_used.dtype)
        col_used[tiles, j] += go.to(col_used.dtype)
    return keep


def _fused_pays(w: torch.Tensor, repeated: bool) -> bool:
    """Whether the compiled 2:4 kernel is worth it: a large weight on the CPU whose mask is asked for
    again and again (a periodic refresh). A one-off mask keeps the table, with no compile (seconds)."""
    return repeated and w.device.type == "cpu" and w.numel() >= 16 * FUSED_MIN_TILES


def _fused_mask(w: torch.Tensor) -> torch.Tensor:
    """The exact 2:4 mask through one compiled kernel (:func:`fused_2_4`): the table's masks, faster.

    The magnitudes go in entry-major (``[16, tiles]``, one strided copy), so that the kernel reads
    each entry of consecutive tiles contiguously; the chosen patterns come back the same way.
    """
    r, c, *rest = w.shape
    split = (r // 4, 4, c // 4, 4, *rest)
    order = [1, 3, 0, 2, *range(4, w.dim() + 2)]  # -> [4, 4, R/4, C/4, *rest]
    a16 = torch.empty([split[i] for i in order], dtype=torch.float32, device=w.device)
    tiles = w.detach().reshape(split).permute(order)
    if w.dtype == torch.float32:
        torch.abs(tiles, out=a16)  # one pass (a16.copy_ then abs_ takes twice as long)
    else:
        a16.copy_(tiles).abs_()
    big = torch.finfo(torch.float32).max
    a16 = torch.nan_to_num_(a16, nan=0.0, posinf=big).reshape(16, -1)  # as _magnitudes
    index, table = fused_2_4(a16), pattern_table(2, 4).to(w.device)
    out = torch.empty(w.shape, dtype=torch.bool, device=w.device)
    if not rest:  # a tile row's 4 entries are adjacent bytes: move each as one int32 (4x faster)
        rows = torch.index_select(table.view(torch.uint8).view(torch.int32), 0, index)  # [tiles, 4]
        as_int32 = out.view(torch.uint8).view(torch.int32).view(r // 4, 4, c // 4)
        as_int32.permute(0, 2, 1).copy_(rows.view(r // 4, c // 4, 4))
    else:
        keep = table[index]  # [tiles, 16]
        out.view(split).permute(0, 2, *range(4, w.dim() + 2), 1, 3).copy_(keep.view(r // 4, c // 4, *rest, 4, 4))
    return out


# ----------------------------------------------------------------------------- public API


def transposable_mask(w: torch.Tensor, n: int, m: int, method: str = "auto", *, repeated: bool = False) -> torch.Tensor:
    """Boolean mask of ``w``'s shape with exactly ``n`` ones per row and column of every m x m tile.

    Axes 0 and 1 are tiled (both must be divisible by ``m``); further axes are independent
    batches. ``method`` is ``"exact"`` (optimal kept magnitude per tile), ``"greedy"`` (fast, at
    least half of the optimum per tile) or ``"auto"`` (exact when ``m <= 4``, greedy otherwise).
    Any float dtype and device; magnitudes are scored in float32 (greedy) or exactly (exact).
    ``repeated``: the caller asks for this shape's mask again and again (a periodic refresh), so a
    large exact 2:4 mask on the CPU may come from the compiled kernel (same choices, compiled once).
    """
    n, m = _check_nm(n, m)
    if method not in _METHODS:
        choices = ", ".join(_METHODS)
        raise ValueError(f"unknown transposable mask method {method!r}; use one of {choices}")
    _check_shape(w, m, "weight")
    if w.dtype == torch.bool:
        raise ValueError("transposable_mask needs a numeric weight, got a bool tensor")
    if method == "auto":
        method = "exact" if m <= MAX_TABLE_M else "greedy"
    with torch.no_grad():
        if method == "exact" and (n, m) == (2, 4) and _fused_pays(w, repeated):
            return _fused_mask(w)
        tiles = _to_tiles(_magnitudes(w), m)
        if tiles.shape[0] == 0:
            return torch.zeros(w.shape, dtype=torch.bool, device=w.device)
        keep = exact_tiles(tiles, n) if method == "exact" else _greedy_tiles(tiles, n)
        return _from_tiles(keep, w.shape, m)


def tile_counts(mask: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ones per tile row and per tile column of ``mask`` (any dtype; non-zero counts as one).

    Returns ``(row_counts, col_counts)``: ``row_counts[r, b, ...]`` counts ``mask[r, b*m:(b+1)*m,
    ...]`` (shape ``[R, C/m, *rest]``) and ``col_counts[b, c, ...]`` counts ``mask[b*m:(b+1)*m, c,
    ...]`` (shape ``[R/m, C, *rest]``), as int64.
    """
    m = operator.index(m)
    if m < 1:
        raise ValueError(f"tile size M must be >= 1, got {m}")
    _check_shape(mask, m, "mask")
    r, c, *rest = mask.shape
    nz = (mask != 0).to(torch.int64)
    row_counts = nz.reshape(r, c // m, m, *rest).sum(2)
    col_counts = nz.reshape(r // m, m, c, *rest).sum(1)
    return row_counts, col_counts


def is_transposable(mask: torch.Tensor, n: int, m: int) -> bool:
    """Whether every m x m tile of ``mask`` (axes 0, 1) has exactly ``n`` non-zeros per row and column."""
    n, m = _check_nm(n, m)
    row_counts, col_counts = tile_counts(mask, m)
    return bool((row_counts == n).all()) and bool((col_counts == n).all())
