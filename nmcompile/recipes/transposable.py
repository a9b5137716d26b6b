"""Transposable N:M masks (Hubara et al., NeurIPS 2021): the same sparse weight serves FWD and DGRAD.

Every M x M tile of the weight matrix (axes 0 and 1; a conv's kernel positions are separate
matrices; a stacked expert weight ``[E, a, b]`` is one matrix per expert, tiled over ``a, b``) keeps exactly N per row and per column, so ``W`` is N:M along ``in`` and ``W^T`` along
``out``. The mask is a state tensor computed when the weight is annotated and refreshed from the
dense weights every ``every`` optimizer steps: 2:4 by the exact best of the 90 tile patterns,
larger M by a greedy pass with a repair step (``nmcompile.masks.transposable_mask``).

Forward ``W * mask``. Backward: the straight-through gradient plus the masked decay of T-SR-STE
(Hu et al., ICML 2024), ``dW = dW~ + decay * (1 - mask) * W`` on the weights the stored mask
prunes, through the same op path as SR-STE's term (``nmsparse::mask_decay``), so it passes through
the optimizer's momentum and preconditioner. ``decay=0`` is Hubara's plain straight-through
estimator. With ``wgrad="mvue24"`` all three training GEMMs are N:M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import masks
from ..state.clock import new_step
from ..state.sharding import full
from ..masks.transposable import transposable_mask
from ..pattern import NMPattern, is_stacked
from .base import Recipe


def fits_both_axes(recipe, weight: torch.Tensor, dim: int) -> str | None:
    """Tiles span axes 0 and 1 (a stacked expert weight: its last two axes): both must take the pattern."""
    pattern = NMPattern(recipe.n, recipe.m)
    if is_stacked(weight.dim(), dim):
        return pattern.fits(weight, dim) or pattern.fits(weight, -3 - dim)
    return pattern.fits(weight, dim) or pattern.fits(weight, 1 - dim if dim in (0, 1) else 0)


def tile_keep(weight: torch.Tensor, n: int, m: int, dim: int, *, repeated: bool = False) -> torch.Tensor:
    """The boolean transposable mask of ``weight``: over axes 0 and 1, or per expert over the last
    two axes of a stacked weight (the expert axes become the mask's independent batches).
    ``repeated``: a periodic refresh (see :func:`nmcompile.masks.transposable_mask`)."""
    w = weight.detach()
    if is_stacked(w.dim(), dim):
        lead = w.dim() - 2
        keep = transposable_mask(w.movedim(tuple(range(lead)), tuple(range(-lead, 0))), n, m, repeated=repeated)
        return keep.movedim(tuple(range(-lead, 0)), tuple(range(lead)))
    return transposable_mask(w, n, m, repeated=repeated)


def tile_mask(weight: torch.Tensor, n: int, m: int, dim: int) -> torch.Tensor:
    """The transposable mask of ``weight`` as stored state (see :func:`tile_keep`)."""
    return masks.store_mask(tile_keep(weight, n, m, dim))


@dataclass(frozen=True, kw_only=True)
class Transposable(Recipe):
    name = "transposable"
    state_names = ("step", "mask")
    clocked = True

    every: int = 3  # refresh the mask every this many optimizer steps (the cheapest within 1.10x dense, see docs)
    decay: float = 6e-5  # alpha of T-SR-STE's masked decay (GPT-2 124M); 0: plain straight-through

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.every < 1:
            raise ValueError(f"transposable: every must be >= 1 (optimizer steps between refreshes), got {self.every}")
        if not self.decay >= 0:
            raise ValueError(
                f"transposable: decay must be >= 0 (weight of the masked decay on pruned weights; "
                f"default 6e-5, 0 turns it off), got {self.decay}"
            )

    def fits(self, weight, dim):
        return fits_both_axes(self, weight, dim)

    def init_state(self, weight, dim):
        return {"step": new_step(weight), "mask": tile_mask(weight, self.n, self.m, dim)}

    def example_state(self, weight, dim):
        return {"step": new_step(weight), "mask": torch.ones(weight.shape, dtype=masks.STORED_MASK_DTYPE, device=weight.device)}

    def project(self, weight, step, mask, dim, frame=None):
        return torch.ops.nmsparse.mask_decay(weight, mask, float(self.decay))

    def dgrad_pattern(self):
        return (self.n, self.m)  # W^T is N:M along out: the DGRAD GEMM can use the same kind of kernel

    def mask(self, weight, step, mask, dim):
        return mask.bool()

    def state_problem(self, weight, step, mask, dim):
        tiles = mask.movedim(tuple(range(mask.dim() - 2)), tuple(range(2 - mask.dim(), 0))) \
            if is_stacked(mask.dim(), dim) else mask
        other = mask[(mask != 0) & (mask != 1)]
        if other.numel():
            return (f"its stored mask holds values other than 0 and 1 ({other.numel()} of them, e.g. "
                    f"{float(other.flatten()[0]):g}), which scale the kept weights")
        if not masks.is_transposable(tiles, self.n, self.m):
            density = float((mask != 0).float().mean())
            return (f"its stored mask is not a transposable {self.n}:{self.m} mask (density {density:.2f}, "
                    f"expected {self.n / self.m:.2f})")
        return super().state_problem(weight, step, mask, dim=dim)

    def after_step(self, weights, optimizer) -> None:
        for w in weights:
            if w.step % self.every == 0:  # the weights after this step, as the next forward sees them
                w.state["mask"].copy_(tile_keep(full(w.param.detach()), self.n, self.m, w.ann.dim, repeated=True))
