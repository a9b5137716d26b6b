"""How a packed 2:4 weight's token range is decided: the calls up to ``max_tokens`` run the 2:4 CPU kernel, larger
ones the dense GEMM (measured per shape against unpacking the weight for the call; :func:`sparse_ladder`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import cpu24
from ..cpu24.weight import RANGE_ATTR, PackedLinearWeight
from . import DECISION_ATTR, Decision
from .cpu import provenance, sparse_ladder

__all__ = ["token_range", "RangeRule"]


def token_range(out_f: int, in_f: int, dtype: torch.dtype, bias: bool, isa: str, measure: bool) -> tuple[int, tuple, str]:
    """``(max_tokens, ratios, how)``: the measured range, and how it was decided ("" when timed now)."""
    if not measure:
        return -1, (), ""

    if isa == cpu24.A8_ISA:  # int8 weights: the float kernel's range on the shape (INT8_REASON)
        isa = "avx2"
    max_tokens, measured = sparse_ladder(out_f, in_f, dtype, bias, isa, packed_only=True)
    return max_tokens, measured.ratios, provenance(measured)


@dataclass(frozen=True)
class RangeRule:
    """How a packed weight's token range is decided, kept on the weight (:data:`~nmcompile.kernels.cpu24.weight.
    RANGE_ATTR`), so that a conversion to another dtype (``model.to(torch.bfloat16)``, ``.half()``, ``.float()``)
    decides it again for that dtype, as packing in that dtype does: the decision cache's entry, else timed."""

    bias: bool  # the layer adds a bias (timed with it; part of the decision cache's key)
    measure: bool  # False: the kernel takes every token count, not timed, whatever the dtype
    reason: str = "packed only"

    def decide(self, weight: PackedLinearWeight, converted_from: torch.dtype | None = None) -> Decision:
        """Set the range of ``weight`` (``max_tokens``) for its shape, dtype and ISA, and its decision (read by
        :func:`nmcompile.deploy_report`); the decision."""
        max_tokens, ratios, how = token_range(*weight.weight_shape, weight.dtype, self.bias, weight.isa, self.measure)
        reason = self.reason + ("" if self.measure else ", every token count (not timed)")
        if converted_from is not None:
            reason += f"; converted from {converted_from} to {weight.dtype}"
        decision = Decision("cpu24", reason + (f"; {how}" if how else ""), max_tokens=max_tokens, isa=weight.isa,
                            ratios=ratios, speedup=ratios[0][1] if ratios else None)
        weight.max_tokens = max_tokens
        setattr(weight, DECISION_ATTR, decision)
        setattr(weight, RANGE_ATTR, self)
        return decision
