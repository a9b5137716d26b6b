"""The mask-dynamics series of one weight (flip rate, SAD, STEP's Z_t), kept with its recipe record.

Values stay device tensors until read, so recording never waits for the device.
:func:`nmcompile.diagnostics` reads them.
"""

from __future__ import annotations

import torch

__all__ = ["Trace"]


class _Series:
    __slots__ = ("steps", "values", "size")

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.values: torch.Tensor | None = None
        self.size = 0

    def append(self, step: int, value: torch.Tensor) -> None:
        value = value.detach().float()
        if self.values is None:
            self.values = value.new_zeros(64)
        elif self.size == self.values.numel():  # grow by doubling: amortised O(1) per record
            self.values = torch.cat([self.values, torch.zeros_like(self.values)])
        self.values[self.size] = value
        self.size += 1
        self.steps.append(step)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        values = self.values[: self.size].cpu() if self.values is not None else torch.zeros(0)
        return torch.tensor(self.steps, dtype=torch.int64), values


class Trace:
    """The diagnostics of one weight (kept on its annotation, not in the state dict)."""

    def __init__(self) -> None:
        self.series: dict[str, _Series] = {}
        self.first: torch.Tensor | None = None
        self.previous: torch.Tensor | None = None

    def append(self, name: str, step: int, value: torch.Tensor) -> None:
        self.series.setdefault(name, _Series()).append(step, value)

    def record_mask(self, step: int, mask: torch.Tensor) -> None:
        if self.previous is not None and self.previous.shape == mask.shape:
            self.append("flip_rate", step, (mask ^ self.previous).sum() / mask.numel())
            self.append("sad", step, (mask ^ self.first).sum())
        else:
            self.first = mask
        self.previous = mask

    def read(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, series in self.series.items():
            steps, values = series.read()
            out[name] = values
            out[f"{name}_steps"] = steps
        return out
