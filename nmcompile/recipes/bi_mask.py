"""Bi-Mask: separate forward and backward N:M masks (Zhang et al., ICML 2023, arXiv 2302.06058).

- FWD uses ``W * F``, ``F`` the top-N mask along ``in`` (per output row, recomputed every step).
- DGRAD uses ``W * B``: ``B`` is N:M along ``out`` in the row order ``perm`` (within each group of
  M permuted output rows, the N largest ``|W * F|`` that ``F`` keeps), so a kernel that permutes the
  rows the same way gets a real N:M operand for the input gradient.
- WGRAD is dense, plus SR-STE's ``decay * (1 - F) * W``.

``W * B`` is computed in the forward, right after ``W * F``, and kept for the backward (see
:mod:`nmcompile.passes.save_dgrad_weights`): one weight-sized tensor per layer whose input needs
a gradient (with ``torch._functorch.config.activation_memory_budget`` below 1, AOTAutograd's
partitioner may recompute it in the backward instead).

``perm`` is the output-row order, among the identity and ``candidates`` random permutations,
that keeps the most weights in both masks; it is searched when the weight is annotated and every
``every`` optimizer steps. The candidates come from a generator seeded by the optimizer step
alone: the same on every rank (DDP, FSDP2) and after a resume, and the user's random stream is
not touched. Convolutions group ``F`` along input channels and ``B`` along output
channels, per kernel position, on the weight itself (no unfold).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import masks
from ..masks import bits
from ..state.clock import new_step
from ..pattern import is_stacked
from ..state.sharding import full
from .base import Recipe
from .transposable import fits_both_axes


_SEARCH_BYTES = 1 << 26  # packed rows gathered at once by the permutation search (64 MiB)


def out_axis(dim: int) -> int:
    return 1 if dim == 0 else 0


def shared_kept(weight: torch.Tensor, perms: torch.Tensor, n: int, m: int, dim: int) -> torch.Tensor:
    """For each row order in ``perms`` (``[K, out]``), how many non-zero weights both masks keep.

    In each group of ``m`` permuted output rows and each column, ``B`` keeps the ``n`` largest
    ``|W * F|`` that ``F`` keeps, so of the ``c`` non-zero weights ``F`` keeps there it keeps
    ``min(n, c)``. Counted on ``F`` packed to bits, 64 columns a word, for every order at once.
    """
    axis = out_axis(dim)
    kept = masks.keep_mask(weight, n, m, dim) & (weight != 0)
    packed = bits.pack_columns(kept.movedim(axis, 0).flatten(1))  # [out, words]
    chunk = max(1, _SEARCH_BYTES // max(1, packed.numel() * packed.element_size()))
    scores = []
    for orders in perms.split(chunk):
        # rows[i, k, g]: row i of group g in order k, gathered straight into the layout the count reads
        rows = packed[orders.unflatten(1, (-1, m)).permute(2, 0, 1)]
        scores.append(bits.capped_group_counts(rows, n))
    return torch.cat(scores)


def search_permutation(weight: torch.Tensor, n: int, m: int, dim: int, candidates: int, step: int) -> torch.Tensor:
    """The best output-row order among the identity and ``candidates`` random ones (ties: first).

    The random orders at optimizer step ``step`` are always the same ones.
    """
    size = weight.shape[out_axis(dim)]
    gen = torch.Generator().manual_seed(0x5EED + step)
    perms = [torch.arange(size)] + [torch.randperm(size, generator=gen) for _ in range(candidates)]
    perms = torch.stack(perms).to(weight.device)
    scores = shared_kept(weight.detach(), perms, n, m, dim)
    return perms[scores.argmax()]


@dataclass(frozen=True, kw_only=True)
class BiMask(Recipe):
    name = "bi_mask"
    state_names = ("step", "perm")
    clocked = True

    decay: float = 2e-4  # SR-STE term on the weights F prunes
    candidates: int = 100  # K random row orders per search
    every: int = 100  # T: optimizer steps between searches

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.decay >= 0:
            raise ValueError(f"bi_mask: decay must be >= 0 (default 2e-4), got {self.decay}")
        if self.candidates < 0 or self.every < 1:
            raise ValueError(f"bi_mask: need candidates >= 0 and every >= 1, got {self.candidates}, {self.every}")

    def fits(self, weight, dim):
        if is_stacked(weight.dim(), dim):
            return (
                "bi_mask on a stacked (expert) weight: its output-row permutation is searched per weight matrix, "
                "and per-expert permutations (one row order per expert, a per-expert DGRAD mask) are not implemented"
            )
        return fits_both_axes(self, weight, dim)

    def init_state(self, weight, dim):
        return {"step": new_step(weight), "perm": search_permutation(weight, self.n, self.m, dim, self.candidates, 0)}

    def example_state(self, weight, dim):
        return {"step": new_step(weight), "perm": torch.arange(weight.shape[out_axis(dim)], device=weight.device)}

    def project(self, weight, step, perm, dim, frame=None):
        if self.decay:
            return torch.ops.nmsparse.prune_decay(weight, self.n, self.m, dim, float(self.decay))
        return torch.ops.nmsparse.prune(weight, self.n, self.m, dim)

    def dgrad_weight(self, projected, step, perm, dim):
        return torch.ops.nmsparse.backward_mask_weight(projected.detach(), perm, self.n, self.m, dim)

    def dgrad_pattern(self):
        return (self.n, self.m)  # W * B: N:M along out in the row order perm

    def dgrad_order(self, step, perm):
        return perm

    def state_problem(self, weight, step, perm, dim):
        if not torch.equal(perm.sort().values, torch.arange(perm.numel(), device=perm.device)):
            return "its stored row order (perm) is not a permutation"
        return super().state_problem(weight, step, perm, dim=dim)

    def after_step(self, weights, optimizer) -> None:
        for w in weights:
            if w.step % self.every == 0:
                perm = search_permutation(full(w.param), self.n, self.m, w.ann.dim, self.candidates, w.step)
                w.state["perm"].copy_(perm)
