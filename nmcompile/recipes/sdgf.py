"""SDGF, structure-decay gradient flow (progressive gradient flow for high N:M sparsity, arXiv 2402.04744).

The N:M pattern tightens over training in frames, from a mild pattern to the target ``n:m``; each
frame is a hard top-N mask recomputed every step with a straight-through gradient. Frames split the
steps after an optional dense phase (``dense_fraction`` of ``total_steps``) into equal parts.
Schedules for a target N:M:

- ``stepwise``: (M-1):M, then M/2:M, M/4:M, ... down to N:M (1:8: 7:8, 4:8, 2:8, 1:8);
- ``geometric``: N and M shrink together, 8N:8M, 4N:4M, 2N:2M, N:M (1:8: 8:64, 4:32, 2:16, 1:8);
- ``densify``: N fixed, M grows, N:8M, N:4M, N:2M, N:M (1:8: 1:64, 1:32, 1:16, 1:8);
- a custom list ``"4:8/2:8/1:8"`` ending at the target.

A frame with a new M changes the shapes of the mask computation, so each frame gets its own
compiled graph (the backend compiles it when the frame starts); the step clock is a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import masks
from ..state.clock import new_step
from ..pattern import NMPattern
from .base import Recipe
from .mdgf import check_fractions

NAMED = ("stepwise", "geometric", "densify")


def _parse_frames(text: str) -> tuple[tuple[int, int], ...]:
    frames = []
    for part in text.replace(">", "/").split("/"):
        try:
            pattern = NMPattern.of(part)
        except ValueError as err:
            raise ValueError(f"sdgf: schedule entry: {err}") from None
        frames.append((pattern.n, pattern.m))
    return tuple(frames)


@dataclass(frozen=True, kw_only=True)
class SDGF(Recipe):
    name = "sdgf"
    state_names = ("step",)
    clocked = True
    framed = True

    total_steps: int = 0  # required: the run's number of optimizer steps
    schedule: str = "stepwise"  # stepwise | geometric | densify | "N1:M1/N2:M2/.../n:m"
    dense_fraction: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.total_steps <= 0:
            raise ValueError(
                f"sdgf needs total_steps (the run's number of optimizer steps, which the frames divide), "
                f"e.g. sdgf:{self.n}:{self.m},total_steps=10000"
            )
        if not isinstance(self.schedule, str):  # a list of patterns: keep the canonical string form
            object.__setattr__(self, "schedule", "/".join(f"{n}:{m}" for n, m in map(_pair, self.schedule)))
        if self.schedule not in NAMED:
            frames = _parse_frames(self.schedule)
            if frames[-1] != (self.n, self.m):
                raise ValueError(
                    f"sdgf: a custom schedule must end at the recipe's pattern {self.n}:{self.m}, got {self.schedule!r}"
                )
        check_fractions(self, "dense_fraction")
        if len(self.frames) > self.total_steps:
            raise ValueError(f"sdgf: {len(self.frames)} frames do not fit in total_steps={self.total_steps}")

    @property
    def frames(self) -> tuple[tuple[int, int], ...]:
        n, m = self.n, self.m
        if self.schedule == "stepwise":
            frames, k = [(m - 1, m)], m // 2
            while k > n:
                frames.append((k, m))
                k //= 2
            frames.append((n, m))
            return tuple(dict.fromkeys(frames))
        if self.schedule == "geometric":
            return tuple((n * 2**k, m * 2**k) for k in (3, 2, 1, 0))
        if self.schedule == "densify":
            return tuple((n, m * 2**k) for k in (3, 2, 1, 0))
        return _parse_frames(self.schedule)

    @property
    def dense_steps(self) -> int:
        return int(self.dense_fraction * self.total_steps)

    def frame_at(self, step: int) -> int:
        """-1 during the dense phase, then the index into :attr:`frames`."""
        return sum(step >= start for start in self.frame_starts) - 1

    @property
    def frame_starts(self) -> tuple[int, ...]:
        """The optimizer step at which each frame begins: ``dense + int(i * span)``."""
        span = (self.total_steps - self.dense_steps) / len(self.frames)
        return tuple(self.dense_steps + int(i * span) for i in range(len(self.frames)))

    def fits(self, weight: torch.Tensor, dim: int) -> str | None:
        for n, m in self.frames:
            reason = NMPattern(n, m).fits(weight, dim)
            if reason is not None:
                return f"schedule frame {n}:{m}: {reason}"
        return None

    def init_state(self, weight: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
        return {"step": new_step(weight)}

    def pattern_at(self, frame: int) -> tuple[int, int] | None:
        return None if frame < 0 else self.frames[frame]

    def project(self, weight, step, dim, frame=None):
        if frame is None:  # eager use: read the clock
            frame = self.frame_at(int(step))
        pattern = self.pattern_at(frame)
        if pattern is None:
            return weight.clone()
        return torch.ops.nmsparse.prune(weight, *pattern, dim)

    def forward_pattern(self, frame=None):
        return None if frame is None else self.pattern_at(frame)  # the compiled frame's pattern

    def mask(self, weight, step, dim):
        pattern = self.pattern_at(self.frame_at(int(step)))
        if pattern is None:
            return torch.ones_like(weight, dtype=torch.bool)
        return masks.keep_mask(weight.detach(), *pattern, dim)


def _pair(entry) -> tuple[int, int]:
    if isinstance(entry, str):
        return _parse_frames(entry)[0]
    n, m = entry
    return int(n), int(m)
