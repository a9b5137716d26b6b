"""STE: hard top-N-of-M magnitude mask, straight-through gradient.

Forward ``W~ = W * m(W)``, the mask recomputed from the dense weights at every forward. Backward:
the gradient reaches the dense ``W`` unchanged, so pruned weights keep learning and can come back.
No state. (Baseline of SR-STE, Zhou et al., ICLR 2021.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Recipe


@dataclass(frozen=True, kw_only=True)
class STE(Recipe):
    name = "ste"

    def project(self, weight: torch.Tensor, *state: torch.Tensor, dim: int, frame=None) -> torch.Tensor:
        return torch.ops.nmsparse.prune(weight, self.n, self.m, dim)
