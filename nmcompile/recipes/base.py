"""What every recipe shares: its N:M pattern, validation, the string form and the state contract."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..pattern import NMPattern

WGRAD_CHOICES = ("dense",)


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

    n: int = 2  # kept weights per group
    m: int = 4  # group size along the reduction dimension
    wgrad: str = "dense"  # weight-gradient estimator

    def __post_init__(self) -> None:
        NMPattern(self.n, self.m)
        if self.wgrad not in WGRAD_CHOICES:
            raise ValueError(
                f"{self.name}: wgrad={self.wgrad!r} is not available; accepted: "
                f"{', '.join(WGRAD_CHOICES)}{nearest(str(self.wgrad), WGRAD_CHOICES)}"
            )

    @property
    def pattern(self) -> NMPattern:
        return NMPattern(self.n, self.m)

    def init_state(self, weight: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
        """Fresh state tensors for ``weight`` (grouped along ``dim``), keyed by ``state_names``."""
        return {}

    def project(self, weight: torch.Tensor, *state: torch.Tensor, dim: int) -> torch.Tensor:
        """The weight the forward uses: a differentiable function of ``weight`` and the state."""
        raise NotImplementedError

    def __str__(self) -> str:
        parts = [f"{self.name}:{self.n}:{self.m}"]
        for f in dataclasses.fields(self):
            if f.name in ("n", "m"):
                continue
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={value}")
        return ",".join(parts)
