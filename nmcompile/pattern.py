"""N:M conventions: the one place they are defined.

N:M means *N kept out of every M consecutive weights along the reduction dimension* of the
consuming GEMM. Which tensor dimension that is depends on how the layer uses its weight:

==========================  ==============  ===============================================
layer                       weight shape    reduction (grouping) dimension
==========================  ==============  ===============================================
``nn.Linear`` / ``F.linear`` ``[out, in]``   1 (``in``)
GPT-2 ``Conv1D`` (addmm)    ``[in, out]``   0 (``in``)
``nn.Conv1d/2d``            ``[out, in, k..]`` 1 (input channels, one group per output
                                            channel and kernel position: the layout
                                            cuSPARSELt and TensorRT can use)
MoE experts                 ``[E, out, in]`` -1 (``in`` of each expert)
MoE experts, transposed     ``[E, in, out]`` -2 (``in`` of each expert)
==========================  ==============  ===============================================

**Stacked weights.** A weight of three or more dims whose grouping dimension is given as a
*negative* number is a stack of independent layers (one per expert, the leading axes), each
the matrix of its last two axes: ``x @ W``, ``torch.bmm``, ``torch._grouped_mm`` and per-expert
indexing ``W[e]`` followed by a linear/matmul use such weights. A non-negative dimension on a
weight of three or more dims is one layer (a convolution, whose kernel positions are groups of
the same layer). Groups never cross the expert axis either way; what the sign decides is what
"one layer" means for per-layer quantities (S-STE's scale: one per expert, since each expert is a
layer of its own) and for masks that span two axes (transposable tiles: per expert, over the last
two axes). :func:`is_stacked` and :func:`layer_axes` are the one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["NMPattern", "reduction_dim", "is_stacked", "layer_axes", "EXPERT_WEIGHTS"]


@dataclass(frozen=True)
class NMPattern:
    """Keep ``n`` out of every ``m`` consecutive weights (1 <= n < m)."""

    n: int
    m: int

    def __post_init__(self) -> None:
        for field, value in (("n", self.n), ("m", self.m)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"N:M pattern field {field} must be an int, got {value!r}")
        if not 1 <= self.n < self.m:
            raise ValueError(
                f"invalid N:M pattern {self.n}:{self.m}: need 1 <= N < M "
                "(N kept out of every M), e.g. 2:4, 1:4, 4:8, 1:16"
            )

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"

    @classmethod
    def of(cls, value: NMPattern | str) -> NMPattern:
        """``value`` as a pattern: an ``NMPattern``, or a string ``"N:M"`` such as ``"2:4"``."""
        if isinstance(value, cls):
            return value
        n, _, m = value.strip().partition(":") if isinstance(value, str) else ("", "", "")
        if not (n.strip().isdigit() and m.strip().isdigit()):
            raise ValueError(f"{value!r} is not an N:M pattern like '2:4'")
        return cls(int(n), int(m))  # checks 1 <= N < M

    @property
    def density(self) -> float:
        return self.n / self.m

    def fits(self, weight: torch.Tensor, dim: int) -> str | None:
        """Why ``weight`` cannot take this pattern along ``dim``, or None if it can."""
        if not weight.is_floating_point():
            return f"dtype {weight.dtype} is not floating point"
        if weight.dim() < 2:
            return f"{weight.dim()}-D tensor has no reduction dimension"
        size = weight.shape[dim]
        if size % self.m:
            return (
                f"reduction dimension {dim} has size {size}, not divisible by M={self.m} "
                f"(pad it to {size + (-size) % self.m}, pick another M, or exclude this weight)"
            )
        return None


def is_stacked(ndim: int, dim: int) -> bool:
    """Whether a weight of ``ndim`` dims grouped along ``dim`` is a stack of layers (experts)."""
    return dim < 0 and ndim >= 3


def layer_axes(ndim: int, dim: int) -> tuple[int, ...]:
    """The axes that span one layer: the last two of a stacked weight, else all of them."""
    return (ndim - 2, ndim - 1) if is_stacked(ndim, dim) else tuple(range(ndim))


#: 3-D parameters of transformers' experts modules (``@use_experts_implementation``): ``[E, out, in]``,
#: or ``[E, in, out]`` where the module's ``is_transposed`` is True
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "gate_proj", "down_proj")


def _expert_dim(module: nn.Module, param_name: str, weight: torch.Tensor) -> int | None:
    transposed = getattr(module, "is_transposed", None)
    if param_name in EXPERT_WEIGHTS and weight.dim() == 3 and isinstance(transposed, bool):
        return -2 if transposed else -1
    return None


def _is_gpt2_conv1d(module: nn.Module) -> bool:
    # transformers' Conv1D stores its weight as [in, out] and calls addmm(bias, x, W).
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def reduction_dim(module: nn.Module, param_name: str, weight: torch.Tensor) -> int | None:
    """The grouping dimension of ``module.<param_name>``, or None if nmcompile does not know it."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return None
    if isinstance(module, nn.Linear) and param_name == "weight":
        return 1
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and param_name == "weight":
        return 1
    if _is_gpt2_conv1d(module) and param_name == "weight":
        return 0
    if isinstance(module, nn.MultiheadAttention) and param_name.endswith("proj_weight"):
        return 1
    return _expert_dim(module, param_name, weight)
