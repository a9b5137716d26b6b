"""What the one-shot recipes (Wanda, SparseGPT) share: calibration state and the solve contract.

A one-shot recipe prunes a trained model from calibration data instead of training it. Its state is
statistics of the weight's input (``stat``, float32, in the column layout of
:mod:`nmcompile.masks.calibration`, one per expert for stacked weights) and the number of input rows
(tokens) they hold (``count``, int64). Where ``count`` is 0, ``stat`` is undefined (uninitialised
memory, or released by :func:`nmcompile.oneshot.solve.reset`): the first rows overwrite it. The ``nmsparse`` backend inserts ``nmsparse::accumulate_stats``
before each GEMM that reads the weight, so running the compiled model over calibration batches fills
them; the forward uses the dense weight (:meth:`project` is the identity) until
:func:`nmcompile.finalize` calls :meth:`solve_columns` on each matrix and bakes the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..masks.calibration import columns_shape
from .base import Quantized


@dataclass(frozen=True, kw_only=True)
class OneShot(Quantized):
    calibrated: ClassVar[bool] = True
    #: whether ``stat`` is ``X^T X`` ([..., cols, cols]) or the per-column sum of squares ([..., cols])
    gram: ClassVar[bool] = False

    # bits (Quantized): the solve's result rounded to the grid (SparseGPT: the joint solve; Wanda: round to
    # nearest), recorded for pack_weights (:meth:`solve_quantized`)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.wgrad != "dense":
            raise ValueError(
                f"{self.name}: wgrad={self.wgrad!r} does not apply: {self.name} prunes in one shot from calibration "
                "data and trains nothing; leave wgrad out (fine-tune afterwards with asp:N:M,permute=0)"
            )

    def init_state(self, weight, dim):
        experts, cols = columns_shape(weight.shape, dim)
        stat_shape = (*experts, cols, cols) if self.gram else (*experts, cols)
        return {
            # uninitialised: a matrix's statistics mean nothing while its count is 0, and the first calibration
            # rows zero them before adding (masks.calibration.accumulate). So declaring the recipe makes no resident
            # memory for them (untouched pages), and sequential calibration holds one block's at a time
            self.state_names[0]: torch.empty(stat_shape, dtype=torch.float32, device=weight.device),
            "count": torch.zeros(experts, dtype=torch.int64, device=weight.device),
        }

    def project(self, weight, *state, dim, frame=None):
        return weight  # dense until finalize solves

    def forward_pattern(self, frame=None):
        return None

    def state_problem(self, weight, stat, count, dim):
        if bool((count < 0).any()):
            return f"its token count is negative ({int(count.min())})"
        return None

    def solve_columns(self, w: torch.Tensor, stat: torch.Tensor, tokens: int) -> torch.Tensor:
        """The pruned float32 matrix ``w [rows, cols]`` (N:M along ``cols``) from one matrix's statistics."""
        raise NotImplementedError

    def solve_quantized(self, w: torch.Tensor, stat: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(solved w, scales)``: :meth:`solve_columns`, and with ``bits`` the scales of the grid the solved kept
        entries lie on (here: rounded to nearest after the solve; SparseGPT solves jointly instead): ``bits=8`` an
        fp32 scale per row (its largest kept magnitude over 127), ``bits=4`` fp16 ``[rows, cols / group]``
        (:func:`~nmcompile.kernels.cpu24.quantize.round_groups4`). Without ``bits``: ``(w, None)``."""
        return self.to_grid(self.solve_columns(w, stat, tokens))
