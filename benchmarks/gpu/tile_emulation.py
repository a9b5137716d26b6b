"""CPU emulation, in plain torch, of which entries ``torch._sparse_semi_structured_tile`` keeps.

Written from PyTorch's CUDA source, ``aten/src/ATen/native/sparse/cuda/ComputeSparseTile.h``
(``LargestValuesGreedy<Op>`` and ``named_algorithms``) and ``SparseSemiStructuredTile.cu`` (the op):

- the weight is cut into aligned 4x4 tiles; each tile is decided on its own;
- the 16 values of a tile are ranked by ``Op(value)``: ``IdentityOp`` (the signed value) for
  ``"largest_values_greedy"`` and for the default ``""``, ``AbsOp`` (``|value|``) for
  ``"largest_abs_values_greedy"``;
- from the largest down, a value is kept when its row and its column of the tile each hold fewer
  than 2 kept values; zeros take part like any other value, so a tile keeps at most 2 per row and
  per column (at most 8, sometimes fewer), and the kept set is 2:4 along both axes;
- ``"causal1122"`` (a row-by-row rule) is not emulated.

The kernel ranks with a sorting network (``StaticSort``); the order it gives equal keys is not
emulated: ``ties`` picks one, ``"last"`` (of equal keys, the later position in the tile, row-major,
is visited first: what a stable ascending sort read from its end gives, and what reproduces the
4x4 example in PyTorch's ``prune_dense_static_sort`` docstring) or ``"first"``. Ties are between
equal keys: zeros, and in bf16 the odd pair of equal magnitudes. Under ``AbsOp`` the non-zeros of a
tile are visited before its zeros, and a transposable mask's non-zeros all fit, so which of them
are kept does not depend on the tie order.

    python benchmarks/gpu/tile_emulation.py     # kept shares on masked 512 x 512 weights, a few seconds
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

#: algorithm name -> how values are ranked (the registrations of ``named_algorithms``)
ALGORITHMS = {"": "signed", "largest_values_greedy": "signed", "largest_abs_values_greedy": "abs"}
TIES = ("last", "first")


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` -> ``[tiles, 16]``, each row one aligned 4x4 tile in row-major order."""
    rows, cols = t.shape
    return t.reshape(rows // 4, 4, cols // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)


def _untile(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return t.reshape(rows // 4, cols // 4, 4, 4).permute(0, 2, 1, 3).reshape(rows, cols)


def _order(keys: torch.Tensor, ties: str) -> torch.Tensor:
    """Positions 0..15 of every tile, largest key first, equal keys in the ``ties`` order."""
    if ties == "first":
        return torch.sort(keys, dim=1, descending=True, stable=True).indices
    flipped = torch.sort(keys.flip(1), dim=1, descending=True, stable=True).indices
    return 15 - flipped


def tile_keep(w: torch.Tensor, algorithm: str = "", *, ties: str = "last") -> torch.Tensor:
    """Boolean mask of ``w``'s shape: the entries the tile op selects (zeros it selects included)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"tile_keep: algorithm {algorithm!r} is not emulated; use one of {sorted(ALGORITHMS)}")
    if ties not in TIES:
        raise ValueError(f"tile_keep: ties={ties!r} is not one of {TIES}")
    if w.dim() != 2 or w.shape[0] % 4 or w.shape[1] % 4:
        raise ValueError(f"tile_keep: needs a 2-D tensor with both dims multiples of 4, got {tuple(w.shape)}")
    rows, cols = w.shape
    keys = _tiles(w.detach().float())
    if ALGORITHMS[algorithm] == "abs":
        keys = keys.abs()
    order = _order(keys, ties)
    count = keys.shape[0]
    row_kept = torch.zeros(count, 4, dtype=torch.long, device=w.device)
    col_kept = torch.zeros(count, 4, dtype=torch.long, device=w.device)
    keep = torch.zeros(count, 16, dtype=torch.bool, device=w.device)
    for rank in range(16):
        pos = order[:, rank : rank + 1]
        r, c = pos // 4, pos % 4
        fits = (row_kept.gather(1, r) < 2) & (col_kept.gather(1, c) < 2)
        keep.scatter_(1, pos, fits)
        row_kept.scatter_add_(1, r, fits.long())
        col_kept.scatter_add_(1, c, fits.long())
    return _untile(keep, rows, cols)


def kept_share(w: torch.Tensor, keep: torch.Tensor) -> float:
    """Share of ``w``'s non-zeros that ``keep`` keeps (1.0: the tile op would change nothing)."""
    nonzero = w != 0
    total = int(nonzero.sum())
    return float(int((nonzero & keep).sum()) / total) if total else 1.0


def rowwise_24(w: torch.Tensor) -> torch.Tensor:
    """``w`` pruned to 2:4 along its rows by magnitude (what ste, sr_ste, ... give the forward GEMM)."""
    from nmcompile.masks import prune

    return prune(w, 2, 4, 1)


def transposable_24(w: torch.Tensor) -> torch.Tensor:
    """``w`` under nmcompile's transposable 2:4 mask (2 per row and column of every aligned 4x4 tile)."""
    from nmcompile.masks import transposable_mask

    return w * transposable_mask(w, 2, 4)


def random_rowwise_24(w: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``w`` with 2 random entries of every 4 along its rows kept: an MVUE-pruned gradient's pattern."""
    groups = w.reshape(w.shape[0], -1, 4)
    picks = torch.rand(groups.shape, generator=generator, device=w.device).argsort(-1)[..., :2]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, picks, True)
    return (groups * mask).reshape(w.shape)


def summary(size: int = 512, seed: int = 0) -> list[dict]:
    """Kept share of the non-zeros for every mask kind and algorithm on one random ``size`` square."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(size, size, generator=gen)
    masked = {"rowwise": rowwise_24(w), "transposable": transposable_24(w), "random_rowwise": random_rowwise_24(w, gen)}
    out = []
    for kind, t in masked.items():
        for algorithm in ("", "largest_abs_values_greedy"):
            for ties in TIES:
                keep = tile_keep(t, algorithm, ties=ties)
                out.append({"mask": kind, "algorithm": algorithm or '""', "ties": ties, "kept_share": round(kept_share(t, keep), 4),
                            "kept_exactly": bool(torch.equal(t * keep, t))})
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: its nmcompile
    for row in summary():
        print(row)
