"""Pure N:M mask math on tensors: no state, no modules, traceable by Inductor as plain aten ops.

Every function groups ``m`` consecutive elements along ``dim`` (see :mod:`nmcompile.pattern`).

- :mod:`.topn`: top-N of M masks, pruning, S-STE's soft threshold and its scale.
- :mod:`.mvue`: the minimum-variance unbiased N:M estimator for gradients.
- :mod:`.transposable` (and its exact solvers, :mod:`.transposable_exact`): masks that are N:M
  along both axes of every M x M tile.
- :mod:`.permutation`: channel orders that raise the magnitude an N:M mask keeps.
- :mod:`.calibration`: a weight's input as rows in its column layout, and their statistics.
- :mod:`.grids`: the int8 and 4-bit grids kept values are rounded to (the packed formats' values).
- :mod:`.oneshot`: Wanda's and SparseGPT's one-shot pruning of a matrix from those statistics.
"""

from . import calibration, grids, oneshot
from .mvue import inclusion_probabilities, mvue, mvue_variance
from .topn import STORED_MASK_DTYPE, apply_mask, count_violations, keep_mask, prune, prune_row_groups, soft_threshold, soft_threshold_scale, store_mask
from .transposable import is_transposable, tile_counts, transposable_mask

__all__ = [
    "keep_mask", "prune", "prune_row_groups", "store_mask", "apply_mask", "STORED_MASK_DTYPE", "soft_threshold", "soft_threshold_scale", "count_violations",
    "mvue", "mvue_variance", "inclusion_probabilities",
    "transposable_mask", "is_transposable", "tile_counts", "calibration", "grids", "oneshot",
]
