"""SparseGPT: one-shot N:M pruning with second-order weight updates (Frantar & Alistarh, ICML 2023).

From ``H = X^T X / tokens`` (dampened by ``percdamp`` times its mean diagonal), prunes the columns
along the reduction dimension left to right, choosing the N kept of each M by ``w^2 / [H^-1]_jj^2``
and moving each column's pruning error onto the columns not yet done through the inverse Hessian,
``blocksize`` columns at a time (:func:`nmcompile.masks.oneshot.sparsegpt`). ``update=False`` keeps
the chosen mask and the original values (mask only). ``bits=8``: the joint solve (each kept weight
rounded to its row's int8 grid in the sweep, its rounding error moved on as the pruning error is);
``bits=4``: the same on 4-bit grids with a scale per row and ``group`` columns. State: ``xtx`` (``X^T X`` of the inputs that
reached the weight, float32) and ``count`` (tokens). See :mod:`nmcompile.recipes.oneshot`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import masks
from .oneshot import OneShot


@dataclass(frozen=True, kw_only=True)
class SparseGPT(OneShot):
    name = "sparsegpt"
    state_names = ("xtx", "count")
    gram = True

    blocksize: int = 128  # columns per lazy-update block (a multiple of m)
    percdamp: float = 0.01  # dampening, a fraction of the mean diagonal of X^T X
    update: bool = True  # move the pruning error onto the kept weights (False: mask only)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.blocksize, bool) or not isinstance(self.blocksize, int) or self.blocksize < self.m \
                or self.blocksize % self.m:
            raise ValueError(
                f"sparsegpt: blocksize={self.blocksize!r} must be a positive multiple of m={self.m} (so that no "
                f"group of {self.m} straddles two blocks), e.g. sparsegpt:{self.n}:{self.m},blocksize=128"
            )
        if not isinstance(self.percdamp, (int, float)) or isinstance(self.percdamp, bool) or not 0 <= self.percdamp < 1:
            raise ValueError(
                f"sparsegpt: percdamp={self.percdamp!r} must be a float in [0, 1): the dampening added to X^T X as a "
                "fraction of its mean diagonal (default 0.01)"
            )
        if not isinstance(self.update, bool):
            raise ValueError(f"sparsegpt: update={self.update!r} must be True or False")

    def solve_columns(self, w, stat, tokens, scales=None):
        levels = (-8, 7) if self.bits == 4 else 127
        return masks.oneshot.sparsegpt(w, stat, tokens, self.n, self.m, blocksize=self.blocksize,
                                       percdamp=self.percdamp, update=self.update, scales=scales, levels=levels)

    def solve_quantized(self, w, stat, tokens):
        """``bits=8``: the joint solve on each row's grid, the scale the largest kept magnitude of a first solve
        without rounding over 127. The updates push kept entries past the row's largest magnitude before the solve
        (0.5-3.5% of them, up to 2x, in the character GPT's layers), so a grid set from the weights before the
        solve clips them: 0.005 nats of held-out loss there, against -0.001 on the first solve's grid. The cost
        is a second sweep over the same Hessian. ``bits=4``: the same on 4-bit grids, each row and group of
        ``group`` columns scaled from the first solve's kept values (largest magnitude over -8, fp16), each kept
        column rounded in the sweep with its group's scales."""
        if self.bits not in (8, 4):
            return self.solve_columns(w, stat, tokens), None
        from ..kernels.cpu24.quantize import group_scales, row_scales

        first = self.solve_columns(w, stat, tokens)
        scales = row_scales(first) if self.bits == 8 else group_scales(first, 2 * self.group)
        return self.solve_columns(w, stat, tokens, scales), scales
