"""ASP: one-shot magnitude N:M pruning of a trained model, then fine-tuning with the mask fixed.

The mask (top-N of |W| along the reduction dimension) is computed once, when the weight is
annotated, and stored as state; it never changes. Forward ``W * mask``; the gradient is masked
too, so pruned weights get no update from any optimizer and the effective weight stays N:M
without touching the optimizer. With ``permute=True`` (the default), :func:`nmcompile.annotate`
first permutes input channels, together with the producing layers' output channels, to raise
the magnitude the mask keeps without changing the model's function
(:func:`nmcompile.permute.channels.permute_channels`; its report, in the annotation report's
``prepared``, lists the permuted groups, how the function was checked, and each weight left
unpermuted with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import masks
from .base import Recipe
from ..permute.channels import permute_channels


@dataclass(frozen=True, kw_only=True)
class ASP(Recipe):
    name = "asp"
    state_names = ("mask",)

    permute: bool = True  # search input-channel permutations first (annotate only)

    def init_state(self, weight, dim):
        return {"mask": masks.store_mask(masks.keep_mask(weight.detach(), self.n, self.m, dim))}

    def example_state(self, weight, dim):
        return {"mask": torch.ones(weight.shape, dtype=masks.STORED_MASK_DTYPE, device=weight.device)}

    def project(self, weight, mask, dim, frame=None):
        return masks.apply_mask(weight, mask)

    def mask(self, weight, mask, dim):
        return mask.bool()

    def state_problem(self, weight, mask, dim):
        kept = (mask != 0).to(torch.uint8)
        over, _ = masks.count_violations(kept, self.n, self.m, dim)  # more than N kept in a group
        under, _ = masks.count_violations(1 - kept, self.m - self.n, self.m, dim)  # fewer than N
        other = mask[(mask != 0) & (mask != 1)]
        if other.numel():
            return (f"its stored mask holds values other than 0 and 1 ({other.numel()} of them, e.g. "
                    f"{float(other.flatten()[0]):g}), which scale the kept weights")
        if over or under:
            density = float((mask != 0).float().mean())
            return f"its stored mask is not a {self.n}:{self.m} mask (density {density:.2f}, expected {self.n / self.m:.2f})"
        return None

    @property
    def prepares_model(self) -> bool:
        return self.permute

    def prepare(self, model, names):
        if not self.permute:
            return None

        return permute_channels(model, names, self.n, self.m)
