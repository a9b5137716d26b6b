"""Python copies of the 0-d step tensors that drive recipe schedules, kept without device syncs.

Schedules run on optimizer steps, counted in a 0-d int64 ``step`` buffer per weight (so it is saved
with the model). Deciding *in Python* what to do at a step (refresh a mask every k steps, pick the
graph of a schedule frame) needs that count as an int; reading a CUDA tensor every step would stall
the device. A :class:`StepMirror` keeps the int next to the tensor's identity and version counter:
:meth:`advance` updates both, and any other write (``load_state_dict``, ``.to()``) changes the
tensor or its version, so the next :meth:`read` re-reads it once.
"""

from __future__ import annotations

import torch

__all__ = ["StepMirror", "new_step"]


def new_step(weight: torch.Tensor) -> torch.Tensor:
    """A fresh step counter on ``weight``'s device."""
    return torch.zeros((), dtype=torch.int64, device=weight.device)


class StepMirror:
    __slots__ = ("tensor", "version", "value")

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.version = -1
        self.value = 0

    def read(self, step: torch.Tensor) -> int:
        if step.is_inference():  # (loaded or moved under inference_mode) it has no version counter
            self.tensor, self.version, self.value = None, -1, int(step)
        elif step is not self.tensor or step._version != self.version:
            self.tensor, self.version, self.value = step, step._version, int(step)
        return self.value

    def advance(self, step: torch.Tensor) -> int:
        if step.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(
                "nmcompile: a recipe's step counter is an inference tensor (it was loaded or moved under "
                "torch.inference_mode()), so optimizer steps cannot count on it; load the model's state "
                "(or call .to()) outside inference_mode before training"
            )
        value = self.read(step) + 1
        step.add_(1)
        if not step.is_inference():
            self.tensor, self.version, self.value = step, step._version, value
        return value
