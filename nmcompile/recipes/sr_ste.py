"""SR-STE: "Learning N:M Fine-grained Structured Sparse Neural Networks From Scratch" (ICLR 2021).

Forward as STE. Backward adds the sparse-refined term: ``dW = dW~ + decay * (1 - m) * W``, which
pulls only the pruned weights towards zero. The term sits inside the gradient, so it passes through
the optimizer (momentum, Adam's preconditioner). No state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Recipe


@dataclass(frozen=True, kw_only=True)
class SRSTE(Recipe):
    name = "sr_ste"

    decay: float = 2e-4  # lambda_W of the paper: weight of the pruned-weight decay term

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.decay >= 0:
            raise ValueError(f"sr_ste: decay must be >= 0 (paper default 2e-4), got {self.decay}")

    def project(self, weight: torch.Tensor, *state: torch.Tensor, dim: int, frame=None) -> torch.Tensor:
        return torch.ops.nmsparse.prune_decay(weight, self.n, self.m, dim, float(self.decay))
