"""S-STE: "Continuous Pruning Function for Efficient 2:4 Sparse Pre-training" (NeurIPS 2024).

Forward ``W^ = beta * S(W)``: ``S`` shrinks every weight by the (N+1)-th largest magnitude of its
group and zeroes the rest, a continuous projection onto N:M. ``beta = <W, S(W)> / <S(W), S(W)>`` is
one scale per layer (the paper's per-layer definition: one per weight tensor, and one per expert of
a stacked MoE weight, shaped ``[E, 1, 1]``, since each expert is a layer of its own), computed
once from the weights when the weight is first annotated or compiled and then kept fixed
(recomputing it lets it grow and raises the flip rate). Backward is straight-through: the gradient
reaches ``W`` unscaled and unmasked. State: ``beta`` (float32, 0-d or
``[E, 1, 1]``).

``fp8=True`` simulates the paper's FP8 training GEMMs: the forward casts ``X`` and ``W^`` to e4m3,
both backward GEMMs cast their operands to e5m2, each with a per-tensor scale ``max / amax`` taken
from the tensor itself; products accumulate in float32. With ``wgrad="mvue24"`` this is the full
S-STE recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import masks
from .base import Recipe


@dataclass(frozen=True, kw_only=True)
class SSTE(Recipe):
    name = "s_ste"
    state_names = ("beta",)

    fp8: bool = False  # simulate FP8 GEMMs (e4m3 forward, e5m2 backward, per-tensor dynamic scales)

    def init_state(self, weight: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
        return {"beta": masks.soft_threshold_scale(weight, self.n, self.m, dim)}

    def project(self, weight: torch.Tensor, *state: torch.Tensor, dim: int, frame=None) -> torch.Tensor:
        (beta,) = state
        return torch.ops.nmsparse.soft_threshold(weight, beta, self.n, self.m, dim)

    def forward_factors(self, weight, *state, dim, frame=None):
        """``(S(W), beta)``: a 2:4 GEMM multiplies by ``S(W)`` and scales its output by the fixed ``beta``."""
        (beta,) = state
        return torch.ops.nmsparse.soft_threshold(weight, torch.ones_like(beta), self.n, self.m, dim), beta
