"""What every recipe shares: its N:M pattern, validation, the string form and the state contract."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import masks
from ..pattern import NMPattern

#: weight-gradient estimators: the dense gradient, or MVUE N:M sparsification of the output gradient
#: along the token dimension (the WGRAD GEMM's reduction), unbiased and of minimum variance
WGRAD_CHOICES = ("dense", "mvue12", "mvue24")
MVUE_PATTERNS = {"mvue12": (1, 2), "mvue24": (2, 4)}


def nearest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base of all recipes: keep ``n`` of every ``m`` weights along the reduction dimension.

    A recipe is a frozen value: hashable, comparable, and fixed for a whole training run. Anything
    that changes while training (a scale, a step counter, a mask) is *state*: tensors listed in
    ``state_names``, created by :meth:`init_state` and stored as buffers of the weight's module.
    """

    name: ClassVar[str] = ""
    state_names: ClassVar[tuple[str, ...]] = ()
    #: the state holds ``step``, a 0-d int64 count of optimizer steps advanced by
    #: :func:`nmcompile.hook_optimizer` (schedules run on optimizer steps, not forwards)
    clocked: ClassVar[bool] = False
    #: the projection's shapes depend on the step (a schedule of N:M patterns): the backend
    #: compiles one graph per frame, see :meth:`frame_at`
    framed: ClassVar[bool] = False

    n: int = 2  # kept weights per group
    m: int = 4  # group size along the reduction dimension
    wgrad: str = "dense"  # weight-gradient estimator

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # inf or nan in any hyperparameter makes the weights NaN
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(
                    f"{self.name}: {f.name}={value} is not a finite number; {f.name} takes a finite float "
                    f"(default {f.default!r}), e.g. {self.name}:N:M,{f.name}={f.default!r}"
                )
        NMPattern(self.n, self.m)
        if self.wgrad not in WGRAD_CHOICES:
            raise ValueError(
                f"{self.name}: wgrad={self.wgrad!r} is not available; accepted: "
                f"{', '.join(WGRAD_CHOICES)}{nearest(str(self.wgrad), WGRAD_CHOICES)}"
            )

    @property
    def pattern(self) -> NMPattern:
        return NMPattern(self.n, self.m)

    def fits(self, weight: torch.Tensor, dim: int) -> str | None:
        """Why ``weight`` (grouped along ``dim``) cannot take this recipe, or None if it can."""
        return self.pattern.fits(weight, dim)

    def init_state(self, weight: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
        """Fresh state tensors for ``weight`` (grouped along ``dim``), keyed by ``state_names``."""
        return {}

    def example_state(self, weight: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
        """State of the right shapes and dtypes for compiling (values unused; may run on fake tensors)."""
        return self.init_state(weight, dim)

    def prepare(self, model, names: list[str]):
        """Model-level work before the weights ``names`` get this recipe (ASP's channel permutation).

        Called by :func:`nmcompile.annotate`; returns a report or None.
        """
        return None

    @property
    def prepares_model(self) -> bool:
        """Whether :meth:`prepare` changes the model (then only ``annotate`` can declare it fully)."""
        return False

    def project(self, weight: torch.Tensor, *state: torch.Tensor, dim: int, frame: int | None = None) -> torch.Tensor:
        """The weight the forward uses: a differentiable function of ``weight`` and the state.

        ``frame`` is given only to framed recipes when they are compiled; in eager use they read it
        from their ``step`` state.
        """
        raise NotImplementedError

    def dgrad_weight(self, projected: torch.Tensor, *state: torch.Tensor, dim: int) -> torch.Tensor | None:
        """The weight the input gradient (DGRAD) uses, when it differs from the forward's (Bi-Mask).

        ``projected`` is :meth:`project`'s output, so the forward mask is not computed twice.
        """
        return None

    def mask(self, weight: torch.Tensor, *state: torch.Tensor, dim: int) -> torch.Tensor:
        """The boolean mask the forward applies now (diagnostics: flip rate, SAD)."""
        return masks.keep_mask(weight.detach(), self.n, self.m, dim)

    def frame_at(self, step: int) -> int:
        """Index of the schedule frame at optimizer step ``step`` (framed recipes only)."""
        return 0

    @property
    def mvue(self) -> tuple[int, int] | None:
        """The N:M pattern of the MVUE weight-gradient estimator, or None for the dense gradient."""
        return MVUE_PATTERNS.get(self.wgrad)

    @property
    def rewrites_consumer(self) -> bool:
        """Whether the GEMM itself needs nmcompile's op (its backward differs from aten's)."""
        return self.mvue is not None or getattr(self, "fp8", False) or type(self).dgrad_weight is not Recipe.dgrad_weight

    # Called by nmcompile.hook_optimizer with every weight that carries this recipe
    # (a list of nmcompile.training.optimizer_hook.Tracked), in place and under no_grad.
    def before_step(self, weights, optimizer) -> None:
        """Before each optimizer step (STEP reads the gradients and Adam's state here)."""

    def after_step(self, weights, optimizer) -> None:
        """After each optimizer step, once each weight's clock reads ``Tracked.step`` (refresh masks)."""

    def __str__(self) -> str:
        parts = [f"{self.name}:{self.n}:{self.m}"]
        for f in dataclasses.fields(self):
            if f.name in ("n", "m"):
                continue
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={value}")
        return ",".join(parts)
