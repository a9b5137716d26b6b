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
    #: :meth:`before_step` reads the step's gradients: with ``optimizer.step(closure)`` the closure is
    #: evaluated before it (see :mod:`nmcompile.training.step_driver`)
    reads_gradients: ClassVar[bool] = False
    #: a one-shot recipe (:mod:`nmcompile.recipes.oneshot`): its state is calibration statistics
    #: gathered in the graph by ``nmsparse::accumulate_stats``, solved by :func:`nmcompile.finalize`
    calibrated: ClassVar[bool] = False

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

    # ---- what the training GEMMs can rely on (the 2:4 training kernels, see nmcompile.kernels.train_gemms)

    def forward_pattern(self, frame: int | None = None) -> tuple[int, int] | None:
        """The N:M pattern :meth:`project`'s output has along ``dim`` by construction (None: not N:M).

        Read from the declaration alone, never from weight values; a recipe with a
        :meth:`forward_gate` has it only while the gate is on.
        """
        return (self.n, self.m)

    def forward_gate(self, *state: torch.Tensor) -> torch.Tensor | None:
        """A 0-d bool tensor: the forward weight has :meth:`forward_pattern` only while it is True (None: always)."""
        return None

    def forward_factors(self, weight: torch.Tensor, *state: torch.Tensor, dim: int, frame: int | None = None):
        """``(operand, scale)`` with ``project(...) == scale * operand``, ``scale`` 0-d and the gradient
        reaching ``weight`` as through :meth:`project`, so a GEMM can scale its output instead of a copy
        of the weight; None when the projection has no such factor."""
        return None

    def dgrad_pattern(self) -> tuple[int, int] | None:
        """The N:M pattern of the DGRAD weight (:meth:`dgrad_weight`, else the forward weight) along the
        output axis, in the row order :meth:`dgrad_order` (None: not N:M along ``out``)."""
        return None

    def dgrad_order(self, *state: torch.Tensor) -> torch.Tensor | None:
        """The output-row order in which the DGRAD weight is N:M along ``out`` (None: as stored)."""
        return None

    def state_mismatch(self, key: str, shape: tuple[int, ...]) -> str | None:
        """Which setting of this recipe differs when a checkpoint's state ``key`` has ``shape``, not
        the shape this recipe gives it (said when such a checkpoint is loaded); None: no setting of
        the recipe decides that shape."""
        return None

    def mask(self, weight: torch.Tensor, *state: torch.Tensor, dim: int) -> torch.Tensor:
        """The boolean mask the forward applies now (diagnostics: flip rate, SAD)."""
        return masks.keep_mask(weight.detach(), self.n, self.m, dim)

    def grid(self, weight: torch.Tensor, *state: torch.Tensor, dim: int) -> torch.Tensor | None:
        """The scales of the integer grid :meth:`project`'s output lies on (per output row: fp32 ``[rows]`` for
        int8, fp16 ``[rows, cols / group]`` for 4-bit), recorded by :func:`nmcompile.finalize` so the packed model
        serves exactly those values; None: float values."""
        return None

    def state_problem(self, weight: torch.Tensor, *state: torch.Tensor, dim: int) -> str | None:
        """What makes ``state`` something this recipe never stores (a mask that is not N:M, a negative
        step clock), or None. Read by :func:`nmcompile.check`; one pass over the state."""
        if self.clocked:
            step = state[self.state_names.index("step")]
            if int(step) < 0:
                return f"its step clock reads {int(step)}"
        return None

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
    # (a list of nmcompile.training.step_driver.Tracked), in place and under no_grad.
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


@dataclass(frozen=True, kw_only=True)
class Quantized(Recipe):
    """A recipe whose kept weights end on integer grids, the values of the packed CPU formats
    (:mod:`nmcompile.masks.grids`): ``bits=8`` a symmetric int8 grid with an fp32 scale per output row, ``bits=4``
    4-bit grids with an fp16 scale per row and ``group`` positions (64 or 128) along the reduction dimension;
    ``bits=None`` (the default): float values."""

    #: 8 or 4: the kept weights' integer grid; None: float values
    bits: int | None = None
    #: bits=4: the positions one scale covers (64 or 128)
    group: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in (8, 4)):
            raise ValueError(
                f"{self.name}: bits={self.bits!r} is not supported; bits=8 puts the kept weights on an int8 grid with "
                f"a scale per output row ({self.name}:{self.n}:{self.m},bits=8), bits=4 on 4-bit grids with a scale per "
                f"row and group of columns ({self.name}:{self.n}:{self.m},bits=4,group=64), or leave bits out for "
                "float values"
            )
        if self.group not in (64, 128) or isinstance(self.group, bool):
            raise ValueError(f"{self.name}: group={self.group!r} is not supported; a 4-bit scale covers 64 or 128 "
                             f"columns ({self.name}:{self.n}:{self.m},bits=4,group=128)")

    def to_grid(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(w on its grids, scales)`` of a matrix ``w [rows, cols]`` (rows: output rows) rounded to nearest as
        ``bits`` says: ``bits=8`` fp32 scales ``[rows]``, ``bits=4`` fp16 ``[rows, cols / group]``; ``(w, None)``
        without ``bits``. NaN or infinite weights are refused by name."""
        from ..kernels.cpu24 import quantize

        if self.bits == 8:
            return quantize.round_rows(w)
        if self.bits == 4:
            return quantize.round_groups4(w, self.group), quantize.group_scales(w, 2 * self.group)
        return w, None
