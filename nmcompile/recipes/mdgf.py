"""MDGF, mask-decay gradient flow (progressive gradient flow for high N:M sparsity, arXiv 2402.04744).

Forward ``W * (m + (1 - m) * alpha_t)``: the top-N mask ``m`` is recomputed from the dense weights
every step, and pruned weights still contribute, scaled by ``alpha_t``, which decays with the
optimizer step ``t``: ``exp(-c t)`` (``schedule="exp"``) or ``max(0, 1 - c t)`` (``"linear"``), with
``c = decay_coef``. Backward is straight-through. Optional phases, as fractions of ``total_steps``:
``dense_fraction`` of dense steps first (alpha = 1, the decay clock starts when it ends), and
``finetune_fraction`` of binary-mask steps last (alpha = 0). ``alpha_t`` is computed in the graph
from the ``step`` state tensor, so the decay never recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..state.clock import new_step
from .base import Recipe


def check_fractions(recipe, *names: str) -> None:
    """Shared validation of schedule phases given as fractions of ``total_steps``."""
    fractions = {name: getattr(recipe, name) for name in names}
    for name, value in fractions.items():
        if not 0 <= value < 1:
            raise ValueError(f"{recipe.name}: {name} must be in [0, 1) (a fraction of total_steps), got {value}")
    if sum(fractions.values()) >= 1:
        raise ValueError(f"{recipe.name}: {' + '.join(names)} must leave some steps for the sparse phase")
    if any(fractions.values()) and recipe.total_steps <= 0:
        raise ValueError(
            f"{recipe.name}: {', '.join(n for n, v in fractions.items() if v)} need total_steps "
            f"(the run's number of optimizer steps), e.g. {recipe.name}:{recipe.n}:{recipe.m},total_steps=10000"
        )


@dataclass(frozen=True, kw_only=True)
class MDGF(Recipe):
    name = "mdgf"
    state_names = ("step",)
    clocked = True

    decay_coef: float = 2e-4  # c in alpha_t
    schedule: str = "exp"  # "exp": exp(-c t); "linear": max(0, 1 - c t)
    dense_fraction: float = 0.0
    finetune_fraction: float = 0.0
    total_steps: int = 0  # needed only with the fractions

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.schedule not in ("exp", "linear"):
            raise ValueError(f"mdgf: schedule must be 'exp' or 'linear', got {self.schedule!r}")
        if not self.decay_coef >= 0:
            raise ValueError(f"mdgf: decay_coef must be >= 0 (default 2e-4), got {self.decay_coef}")
        check_fractions(self, "dense_fraction", "finetune_fraction")

    @property
    def dense_steps(self) -> int:
        return int(self.dense_fraction * self.total_steps)

    @property
    def finetune_start(self) -> int | None:
        return self.total_steps - int(self.finetune_fraction * self.total_steps) if self.finetune_fraction else None

    def init_state(self, weight: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
        return {"step": new_step(weight)}

    def alpha(self, step: torch.Tensor) -> torch.Tensor:
        """The factor on pruned weights at optimizer step ``step`` (0-d float32)."""
        t = step.float()
        s = (t - self.dense_steps).clamp_min(0)
        if self.schedule == "exp":
            a = torch.exp(-self.decay_coef * s)
        else:
            a = (1 - self.decay_coef * s).clamp_min(0)
        if self.dense_steps:
            a = torch.where(t < self.dense_steps, 1.0, a)
        if self.finetune_start is not None:
            a = torch.where(t >= self.finetune_start, 0.0, a)
        return a

    def project(self, weight, step, dim, frame=None):
        kept = torch.ops.nmsparse.prune(weight, self.n, self.m, dim)
        # kept + alpha * (w - kept) = w * (m + (1 - m) * alpha); straight-through, since prune is
        return kept + self.alpha(step).to(weight.dtype) * (weight - kept)

    def forward_pattern(self, frame=None):
        return None  # pruned weights still count, scaled by alpha_t (N:M only once alpha_t is 0)
