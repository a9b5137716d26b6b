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

``bits=8`` or ``bits=4`` (``group=64`` or ``128``) rounds the masked weight onto the packed CPU formats' grids
in every forward (``nmsparse::round_to_grid``: each output row's int8 grid, or its 4-bit grids of ``group``
positions, recomputed from the weight each step), with a straight-through gradient (masked as above): the
model trains on the values ``pack_weights(model, bits=...)`` will serve, and :func:`nmcompile.finalize` bakes
those values and records their grids, so the saved directory holds them as codes. This is how a 2:4+int4
model recovers as a 2:4+int4 model (``nmcompile recover`` picks it for a directory of 8- or 4-bit weights).
Linear-shaped (2-D) weights only, and for ``bits=4`` a reduction length that ``group`` divides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import masks
from .base import Quantized
from ..permute.channels import permute_channels


@dataclass(frozen=True, kw_only=True)
class ASP(Quantized):
    name = "asp"
    state_names = ("mask",)

    permute: bool = True  # search input-channel permutations first (annotate only)

    def init_state(self, weight, dim):
        return {"mask": masks.store_mask(masks.keep_mask(weight.detach(), self.n, self.m, dim))}

    def example_state(self, weight, dim):
        return {"mask": torch.ones(weight.shape, dtype=masks.STORED_MASK_DTYPE, device=weight.device)}

    def fits(self, weight, dim):
        why = super().fits(weight, dim)
        if why is None and self.bits is not None:
            if weight.dim() != 2:
                why = f"bits={self.bits} rounds output rows of a 2-D weight; this one is {weight.dim()}-D"
            elif self.bits == 4 and weight.shape[dim] % self.group:
                why = (f"bits=4 needs its reduction length ({weight.shape[dim]}) to be a multiple of "
                       f"group={self.group}")
        return why

    def project(self, weight, mask, dim, frame=None):
        kept = masks.apply_mask(weight, mask)
        if self.bits is None:
            return kept
        return torch.ops.nmsparse.round_to_grid(kept, self.bits, self.group, dim)

    def grid(self, weight, mask, dim):
        if self.bits is None:
            return None
        kept = masks.apply_mask(weight, mask)
        return self.to_grid(kept if dim % 2 == 1 else kept.t())[1]

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
