"""Exact solvers for transposable N:M masks (see :mod:`nmcompile.masks.transposable`).

Per M x M tile, the mask with N ones in every row and column that keeps the most magnitude:
by enumerating every valid pattern for M <= 4 (for 2:4 also as one compiled kernel that makes the
same choices, :func:`fused_2_4`), by min-cost flow for larger M. Magnitudes are
rounded to integer multiples of ``2**-40`` of the tile's largest one and scored in float64, so
all sums are exact and ties are true ties.
"""

from __future__ import annotations

import functools
import itertools

import torch

_QUANT_BITS = 40  # magnitudes become integers <= 2**40, float64 sums exact for m < 4096
MAX_TABLE_M = 4  # exact by enumeration up to 4x4 tiles (at most 90 patterns, 16 entries each)

# tiles per chunk, so that the per-chunk work tensors stay around tens of MB
_TABLE_CHUNK = 1 << 16
_FLOW_ELEMS = 1 << 20


def chunks(total: int, size: int):
    size = max(1, size)
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))



def _quantize(a: torch.Tensor) -> torch.Tensor:
    """Tile magnitudes ``[T, m, m]`` as integers in ``[0, 2**40]`` (float64), scaled per tile."""
    a = a.double()
    top = a.amax(dim=(1, 2), keepdim=True)
    scale = torch.where(top > 0, float(2**_QUANT_BITS) / top, torch.zeros_like(top))
    return torch.round(a * scale)


@functools.lru_cache(maxsize=None)
def pattern_table(n: int, m: int) -> torch.Tensor:
    """All m x m 0/1 matrices with n ones per row and per column, flattened row-major ``[P, m*m]``.

    Order: lexicographic in the rows' column choices (row 0 first, each row's choices in
    ``itertools.combinations`` order); the exact table solver breaks ties by this order.
    """
    rows = list(itertools.combinations(range(m), n))
    table = []
    for choice in itertools.product(rows, repeat=m):
        cols = [0] * m
        for picked in choice:
            for j in picked:
                cols[j] += 1
        if all(c == n for c in cols):
            table.append([1 if j in picked else 0 for picked in choice for j in range(m)])
    return torch.tensor(table, dtype=torch.bool)


def _exact_by_table(a: torch.Tensor, n: int) -> torch.Tensor:
    """Optimal masks ``[T, m, m]`` by scoring every valid pattern (small m only)."""
    t, m, _ = a.shape
    table = pattern_table(n, m).to(a.device)
    weights = table.double().t()  # [m*m, P]
    out = torch.empty(t, m * m, dtype=torch.bool, device=a.device)
    for s in chunks(t, _TABLE_CHUNK):
        scores = _quantize(a[s]).reshape(-1, m * m) @ weights  # integer sums: exact in float64
        out[s] = table[scores.argmax(dim=1)]  # first best pattern on ties
    return out.reshape(t, m, m)


def _exact_by_flow(a: torch.Tensor, n: int) -> torch.Tensor:
    """Optimal masks ``[T, m, m]`` by min-cost flow, all tiles of a chunk in lockstep.

    Per tile the network is source -> row i (capacity n) -> column j (capacity 1, cost -|w_ij|)
    -> sink (capacity n). Successive shortest paths: starting from the empty mask, n*m times add
    one unit of flow along a cheapest source-sink path of the residual graph; every intermediate
    flow is then a cheapest one of its size, so the residual graph never has a negative cycle and
    the final n*m-unit flow is an optimal mask. In the residual graph a path enters at a row with
    fewer than n ones, alternates "row i -> column j, turn (i, j) on, cost -|w_ij|" and "column j ->
    row i, turn (i, j) off, cost +|w_ij|", and leaves from a column with fewer than n ones, so
    only two distance vectors (rows, columns) are needed. Bellman-Ford alternates the two
    relaxations; a shortest path uses each column at most once, so m rounds suffice, and it stops
    early once no row distance improves. Updates are taken only on strict improvement and the
    costs are exact integers, so the predecessor links form a tree and the traced path is simple.
    """
    t, m, _ = a.shape
    out = torch.empty(t, m, m, dtype=torch.bool, device=a.device)
    for s in chunks(t, _FLOW_ELEMS // (m * m)):
        out[s] = _flow_chunk(_quantize(a[s]), n)
    return out


def _flow_chunk(q: torch.Tensor, n: int) -> torch.Tensor:
    t, m, _ = q.shape
    dev = q.device
    inf = float("inf")
    # work arrays keep the reduced index first, so each relaxation reads contiguous [t, m] slices
    add_q = (-q).permute(1, 0, 2).contiguous()  # [i, t, j]: cost of row i -> column j
    drop_q = q.permute(2, 0, 1).contiguous()  # [j, t, i]: cost of column j -> row i
    on = torch.zeros(m, t, m, dtype=torch.bool, device=dev)  # [i, t, j]
    row_used = torch.zeros(t, m, dtype=torch.long, device=dev)
    col_used = torch.zeros(t, m, dtype=torch.long, device=dev)
    tiles = torch.arange(t, device=dev)
    via_dtype = torch.int16 if m < 2**15 else torch.long  # predecessor indices: small is faster
    for _ in range(n * m):
        add_cost = add_q.masked_fill(on, inf)
        drop_cost = drop_q.masked_fill(~on.permute(2, 1, 0), inf).contiguous()
        d_row = torch.zeros(t, m, dtype=q.dtype, device=dev).masked_fill_(row_used >= n, inf)
        via_col = torch.full((t, m), -1, dtype=via_dtype, device=dev)  # -1: straight from the source
        d_col = torch.full((t, m), inf, dtype=q.dtype, device=dev)
        via_row = torch.zeros(t, m, dtype=via_dtype, device=dev)
        for _ in range(m):
            for i in range(m):  # columns from rows; increasing i with "<" keeps the first best row
                cand = d_row[:, i : i + 1] + add_cost[i]
                better = cand < d_col
                d_col = torch.where(better, cand, d_col)
                via_row.masked_fill_(better, i)
            changed = torch.zeros(t, m, dtype=torch.bool, device=dev)
            for j in range(m):  # rows from columns
                cand = d_col[:, j : j + 1] + drop_cost[j]
                better = cand < d_row
                d_row = torch.where(better, cand, d_row)
                via_col.masked_fill_(better, j)
                changed |= better
            if not bool(changed.any()):
                break
        # leave through the cheapest column that still has room (lowest index on ties)
        j = d_col.masked_fill(col_used >= n, inf).argmin(dim=1)
        col_used[tiles, j] += 1
        via_row, via_col = via_row.long(), via_col.long()
        alive = torch.ones(t, dtype=torch.bool, device=dev)
        for _ in range(m):  # trace back: at most one "on" and one "off" per column
            i = via_row.gather(1, j[:, None]).squeeze(1)
            on[i, tiles, j] |= alive
            prev = via_col.gather(1, i[:, None]).squeeze(1)
            row_used[tiles, i] += (alive & (prev < 0)).long()
            alive = alive & (prev >= 0)
            if not bool(alive.any()):
                break
            j_prev = prev.clamp(min=0)
            on[i, tiles, j_prev] &= ~alive
            j = torch.where(alive, j_prev, j)
    return on.permute(1, 0, 2)


def exact_tiles(a: torch.Tensor, n: int) -> torch.Tensor:
    if a.shape[0] == 0:
        return torch.zeros(a.shape, dtype=torch.bool, device=a.device)
    if a.shape[1] <= MAX_TABLE_M:
        return _exact_by_table(a, n)
    return _exact_by_flow(a, n)


# ----------------------------------------------------------------------------- 2:4 in one fused pass

#: below this many tiles the table solver takes a few ms and needs no compile (CPU only; a GPU runs
#: the table's matmul fast enough)
FUSED_MIN_TILES = 4096


@functools.lru_cache(maxsize=None)
def _table_groups() -> tuple[list, dict]:
    """The 2:4 table read as row choices: ``pairs[k]`` is the k-th column pair of a row; for each
    choice ``(k0, k1)`` of rows 0 and 1, the table index of its first pattern and the choices
    ``(k2, k3)`` of rows 2 and 3 that complete it, in table order (the table is sorted by
    ``(k0, k1, k2, k3)``, so a group's patterns are consecutive)."""
    pairs = list(itertools.combinations(range(4), 2))
    groups: dict = {}
    table = pattern_table(2, 4).tolist()
    for index, row in enumerate(table):
        k = [pairs.index(tuple(c for c in range(4) if row[4 * r + c])) for r in range(4)]
        groups.setdefault((k[0], k[1]), (index, []))[1].append((k[2], k[3]))
    return pairs, groups


def _fused_best_2_4(a16: torch.Tensor) -> torch.Tensor:
    """The table solver's 2:4 choice as pointwise math for Inductor: ``a16`` ``[16, T]`` holds each
    tile's magnitudes (finite, row-major entries along axis 0), the result ``[T]`` the index of the
    tile's pattern in the table.

    Magnitudes are quantized as the table solver does and then scaled by 128, so every sum is an
    integer multiple of 128 below 2**53 (exact in float64, in any order). A pattern's key is its
    kept sum plus ``127 - index``: the largest key is the best pattern and, among equal sums, the
    first in table order, which is what the table's arg-max picks; the key's low 7 bits name it.
    The maximum splits over the rows: which patterns rows 2 and 3 may complete depends only on the
    columns rows 0 and 1 leave open, so each set of completions is maximised once and shared,
    about 300 operations per tile instead of 90 x 16. (Sanitising magnitudes or expanding the mask
    in here made Inductor store intermediates and lose vectorization, so both happen outside.)
    """
    pairs, groups = _table_groups()
    a = a16.double()
    top = a.amax(0)
    scale = torch.where(top > 0, float(2**_QUANT_BITS) / top, torch.zeros_like(top))
    q = [torch.round(a[e] * scale) * 128.0 for e in range(16)]
    row = [[q[4 * r + i] + q[4 * r + j] for i, j in pairs] for r in range(4)]
    completions: dict = {}
    key = None
    for (k0, k1), (first, rest) in groups.items():
        done = completions.get(tuple(rest))
        if done is None:
            for rank, (k2, k3) in enumerate(rest):
                candidate = (row[2][k2] + row[3][k3]) - float(rank)
                done = candidate if done is None else torch.maximum(done, candidate)
            completions[tuple(rest)] = done
        candidate = (row[0][k0] + row[1][k1]) + (done + float(127 - first))
        key = candidate if key is None else torch.maximum(key, candidate)
    return (127.0 - (key - torch.floor(key / 128.0) * 128.0)).long()


@functools.lru_cache(maxsize=None)
def _fused_kernel(tiles: int, device: torch.device):
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    _table_groups()  # built from real tensors before tracing
    example = torch.zeros(16, tiles, device=device)
    return compile_fx(make_fx(_fused_best_2_4, tracing_mode="fake")(example), [example])


def fused_2_4(a16: torch.Tensor) -> torch.Tensor:
    """:func:`_fused_best_2_4` by a kernel Inductor compiled for this tile count and device (once)."""
    out = _fused_kernel(a16.shape[1], a16.device)(a16.contiguous())
    return out[0] if isinstance(out, (list, tuple)) else out
