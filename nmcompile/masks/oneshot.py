"""One-shot N:M pruning of a matrix from its input statistics: Wanda and SparseGPT.

Both take the weight as ``W [rows, cols]`` with the N:M groups along ``cols`` (see
:func:`nmcompile.masks.calibration.to_columns`) and compute in float32.

- Wanda (Sun et al., 2023): score ``S_ij = |W_ij| * ||X_j||_2``; keep the N largest scores of every
  M consecutive columns in each row. ``sq`` is ``sum_t X_tj^2`` (a constant factor changes nothing).
- SparseGPT (Frantar & Alistarh, 2023): with ``H = X^T X / tokens + lambda I`` (``lambda`` =
  ``percdamp`` times the mean of its diagonal), columns are pruned left to right; at the first
  column of each group the N columns of largest ``W_ij^2 / [H_F^-1]_jj^2`` are kept (``H_F^-1``: the
  inverse Hessian of the columns not yet done, the rows of the upper Cholesky factor ``U`` of
  ``H^-1``), and every pruned or kept column's error updates the later columns,
  ``W_:,j: -= (w_j - q_j) / U_jj * U_j,j:``. Updates inside a block of ``blocksize`` columns are
  applied at once, to the rest lazily at the block's end (the same result). Inputs that never
  carried signal (``H_jj == 0``) get ``H_jj = 1`` and a zero weight column.
  With ``scales`` (one per row), SparseGPT's joint sparsification and quantization: a kept entry's
  target ``q_j`` is the nearest point of its row's grid (``round(w / s) * s``, at most ``LEVELS`` steps
  from zero) instead of ``w_j`` itself, so the rounding error moves onto the later columns too, as GPTQ
  does, in the same sweep that chooses the mask.
"""

from __future__ import annotations

import contextlib

import torch

from .topn import keep_mask

__all__ = ["wanda", "sparsegpt", "SingularHessian"]


class SingularHessian(ValueError):
    """The damped ``X^T X`` has no Cholesky factor (not positive definite in float32)."""


def wanda(w: torch.Tensor, sq: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """``w`` with the N of every M columns of largest ``|w| * sqrt(sq)`` kept in each row."""
    w = w.float()
    score = w.abs() * sq.float().clamp_min(0).sqrt()
    return w * keep_mask(score, n, m, -1)


def inverse_hessian_factor(xtx: torch.Tensor, tokens: int, percdamp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, dead)``: the upper Cholesky factor of the damped ``H^-1`` and the columns without signal."""
    h = xtx.float() / max(tokens, 1)  # a new tensor: xtx is left as it was
    diag = torch.diagonal(h)
    dead = diag == 0
    diag[dead] = 1
    diag += percdamp * diag.mean()
    # each [K, K] float32 matrix is let go once the next one exists: two at a time, not four (at
    # K = 8192, an MLP's down projection, 268 MB each; this was a 1B prune's peak)
    del diag
    lower, info = torch.linalg.cholesky_ex(h)
    del h
    if int(info):
        raise SingularHessian(f"X^T X with dampening {percdamp} is not positive definite (minor {int(info)})")
    hinv = torch.cholesky_inverse(lower)
    del lower
    upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
    del hinv
    if int(info) or not bool(torch.isfinite(upper).all()):
        raise SingularHessian(f"the inverse of X^T X with dampening {percdamp} has no Cholesky factor")
    return upper, dead


@contextlib.contextmanager
def one_thread():
    """Run the block on one intra-op thread, then restore the count. The column sweep is thousands of
    small ops: split over threads, each waits at a barrier for the slowest thread, which on a shared
    core is descheduled (a [2048, 8192] solve with the 2 cores loaded by other processes: 29-37 s on 2
    threads, 16-21 s on 1). The updates between column blocks keep every thread."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sparsegpt(w: torch.Tensor, xtx: torch.Tensor, tokens: int, n: int, m: int, *, blocksize: int = 128,
              percdamp: float = 0.01, update: bool = True, scales: torch.Tensor | None = None,
              levels: int | tuple[int, int] = 127) -> torch.Tensor:
    """SparseGPT's N:M pruning of ``w`` given ``xtx = X^T X`` over ``tokens`` rows of ``X``.

    ``update=False`` keeps the mask the algorithm chooses and returns the original weights under it.
    ``scales`` (one per row, or ``[rows, cols / group]``: one per row and group of columns): every kept entry
    ends on its grid ``k * s`` (``|k| <= levels``, or ``lo <= k <= hi`` for ``levels=(lo, hi)``; a zero scale
    holds zeros only); with ``update`` its rounding error is moved onto the later columns (the joint solve),
    without it the kept originals are rounded to nearest. Raises :class:`SingularHessian` when the damped
    Hessian cannot be factored.
    """
    original = w.float()
    lo, hi = (-levels, levels) if isinstance(levels, int) else levels
    grid = None
    if scales is not None:  # each column's scales, [cols, rows]
        grid = scales.float()
        grid = grid.unsqueeze(0) if grid.dim() == 1 else grid.t().repeat_interleave(w.shape[1] // grid.shape[1], dim=0)
    upper, dead = inverse_hessian_factor(xtx, tokens, percdamp)
    # columns as rows (contiguous): the column sweep reads and updates whole rows of wt
    wt = original.t().contiguous()
    if update:
        del original  # a float32 copy of a bf16 weight, not needed again
    wt[dead] = 0
    cols, rows = wt.shape
    pruned = torch.zeros_like(wt, dtype=torch.bool)
    diag = torch.diagonal(upper)
    for start in range(0, cols, blocksize):
        end = min(start + blocksize, cols)
        block = wt[start:end]  # a view: updated in place
        u = upper[start:end, start:end]
        err = torch.empty_like(block)
        with one_thread():
            for i in range(end - start):
                if i % m == 0:
                    score = block[i:i + m].square() / diag[start + i:start + i + m].square().unsqueeze(1)
                    drop = torch.topk(score, m - n, dim=0, largest=False).indices + i
                    pruned[start:end].scatter_(0, drop, True)
                col = block[i]
                if grid is None:
                    e = col * pruned[start + i] / u[i, i]  # the error of zeroing the pruned entries
                    block[i:].addr_(u[i, i:], e, alpha=-1.0)
                    block[i].masked_fill_(pruned[start + i], 0.0)
                else:  # kept entries to their row's grid, pruned ones to zero: both errors move on
                    target = _on_grid(col, grid[(start + i) % grid.shape[0]], lo, hi).masked_fill_(pruned[start + i], 0.0)
                    e = (col - target) / u[i, i]
                    block[i:].addr_(u[i, i:], e, alpha=-1.0)
                    block[i].copy_(target)
                err[i] = e
        wt[end:].addmm_(upper[start:end, end:].t(), err, alpha=-1.0)
    if not update:
        kept = original.masked_fill(pruned.t(), 0.0)
        return kept if grid is None else _on_grid(kept.t(), grid.expand(cols, rows), lo, hi).t().contiguous()
    return wt.masked_fill_(pruned, 0.0).t().contiguous()


def _on_grid(cols: torch.Tensor, scales: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Each entry of ``cols`` rounded to its grid (``scales`` broadcast against it; codes ``lo..hi``; 0 where a
    scale is 0)."""
    safe = torch.where(scales != 0, scales, torch.ones_like(scales))
    return torch.round(cols / safe).clamp_(lo, hi).mul_(scales)
