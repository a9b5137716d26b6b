"""What the step driver checks before a step and names: a declared weight a parametrization now
computes, declared weights no ``nmsparse`` graph has used, NaN/inf weights or gradients."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..state import records
from ..state.records import WeightAnnotation

__all__ = ["warn_if_parametrized", "warn_if_never_compiled", "raise_if_not_finite"]


def warn_if_parametrized(module: nn.Module, pname: str, ann: WeightAnnotation, name: str, in_optimizer) -> None:
    """Name (once) a declared weight that a parametrization registered after the declaration now computes."""
    if ann.named is not None or not parametrize.is_parametrized(module, pname):
        return
    original = module.parametrizations[pname].original
    if id(original) not in in_optimizer or original.grad is None:
        return
    ann.named = records.parametrized_reason(name, ann.recipe)
    warnings.warn(f"nmcompile: {ann.named}; this optimizer step trains it dense", stacklevel=4)


def warn_if_never_compiled(groups, used=frozenset()) -> None:
    """Name (once each) declared weights that get a gradient but that no nmsparse graph has used.

    Not those the backend has named with its reason, nor a holder of a weight tied after the
    declaration whose other holder a graph has used (``used``: ids of such weights).
    """
    dense = []
    for weights in groups.values():
        for w in weights:
            if w.ann.named is not None or id(w.param) in used:
                continue
            if not w.ann.consumed and w.param.grad is not None and not w.scratch.get("named"):
                w.scratch["named"] = True
                dense.append(f"{w.name} ({w.ann.recipe})")
    if dense:
        warnings.warn(
            f"nmcompile: {', '.join(dense[:6])}{' ...' if len(dense) > 6 else ''} are declared but no "
            "torch.compile(..., backend='nmsparse') graph has used them, so this optimizer step trains them "
            "dense. Their layers ran outside every compiled graph: the model (or the block holding them) is "
            "not compiled with backend='nmsparse', a graph break runs them eagerly, or each layer is an FSDP2 "
            "unit of its own (apply fully_shard to the blocks that contain the layers, not to the layers)",
            stacklevel=3,
        )


def raise_if_not_finite(groups, step: int) -> None:
    """Name the first annotated weight whose value or gradient holds NaN or inf (before the step runs)."""
    for weights in groups.values():
        for w in weights:
            for what, tensor in (("weight", w.param), ("gradient", w.param.grad)):
                if tensor is None:
                    continue
                bad = int((~torch.isfinite(tensor)).sum())
                if bad:
                    raise FloatingPointError(
                        f"nmcompile: the {what} of {w.name!r} ({w.ann.recipe}) holds {bad} NaN/inf value(s) "
                        f"at optimizer step {step}; the step was not taken, so the weights are those of step "
                        f"{step - 1}. Lower the learning rate, clip gradients, or look for the cause upstream"
                    )
