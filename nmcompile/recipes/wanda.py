"""Wanda: one-shot N:M pruning by weight magnitude times input norm (Sun et al., ICLR 2024).

Keeps, in each output row, the N of every M weights along the reduction dimension with the largest
``|W_ij| * ||X_j||_2``, where ``||X_j||`` is the norm of input feature ``j`` over the calibration
tokens; the kept weights keep their values (``bits=8``: rounded to nearest on each row's int8
grid). State: ``sq`` (per input column, the sum of squares of the inputs that reached the weight) and
``count`` (tokens). See :mod:`nmcompile.recipes.oneshot`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import masks
from .oneshot import OneShot


@dataclass(frozen=True, kw_only=True)
class Wanda(OneShot):
    name = "wanda"
    state_names = ("sq", "count")
    gram = False

    def solve_columns(self, w, stat, tokens):
        return masks.oneshot.wanda(w, stat, self.n, self.m)
