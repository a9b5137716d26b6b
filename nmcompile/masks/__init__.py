"""Pure N:M mask math on tensors: no state, no modules, traceable by Inductor as plain aten ops.

Every function groups ``m`` consecutive elements along ``dim`` (see :mod:`nmcompile.pattern`).

- :mod:`.topn`: top-N of M masks, pruning, S-STE's soft threshold and its scale.
"""

from .topn import count_violations, keep_mask, prune, soft_threshold, soft_threshold_scale

__all__ = ["keep_mask", "prune", "soft_threshold", "soft_threshold_scale", "count_violations"]
