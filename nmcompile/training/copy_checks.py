"""Recipe state of a model's copy that was averaged instead of copied (an EMA), named at a step.

``torch.optim.swa_utils.AveragedModel(model, use_buffers=True)`` keeps a ``copy.deepcopy`` of the
model and averages every buffer of it at each update, recipe state included: masks lose entries
(averaged 0/1 values rounded down) and step clocks lag (``0.9 * 1 + 0.1 * 2`` is 1 again), so the
average computes with a mask and a schedule point the model never had. No nmcompile code runs in
the update or in an eager forward of the copy; the step driver, which watches the copy, looks at
it at the model's next optimizer steps instead: only when the copy's state buffers were written
since the last look (their version counters, no device sync), and at most :data:`LOOKS` times per
weight, each look reading the copy's clock and its model's clock and checking the copy's state as
:func:`nmcompile.check` does. What it finds is warned about once and kept in the copy's record,
where ``check`` and ``finalize`` name it.
"""

from __future__ import annotations

import warnings
import weakref

from torch import nn

from ..state.records import WeightAnnotation, annotation_of
from ..state.sharding import full

__all__ = ["CopySource", "LOOKS", "look_at_copy", "warn_if_averaged"]

#: writes of a copy's state looked at: an average's first update copies, its second one averages
LOOKS = 3


class CopySource:
    """The module and parameter a copied record was copied from, and what the driver saw of the copy."""

    __slots__ = ("module", "pname", "versions", "looks")

    def __init__(self, module: nn.Module, pname: str):
        self.module, self.pname = weakref.ref(module), pname
        self.versions: tuple | None = None  # the copy's state buffers' versions at the last look
        self.looks = LOOKS

    def __reduce__(self):
        return (_unlinked, ())  # a weak reference does not pickle; an unpickled copy is looked at no more


def _unlinked() -> None:
    return None


def _versions(buffers) -> tuple:
    return tuple(-1 if b is None or b.is_inference() else b._version for b in buffers)


def look_at_copy(module: nn.Module, pname: str, ann: WeightAnnotation, name: str, found: list) -> None:
    """Look at the copy's state if it was written since the last look (appends a problem to ``found``)."""
    source = ann.copy_of
    buffers = [module._buffers.get(b) for b in ann.buffer_names(pname)]
    versions = _versions(buffers)
    if versions == source.versions:
        return
    first = source.versions is None
    source.versions = versions
    if first:
        return  # the versions as copied: the next write is the copy's first update
    source.looks -= 1
    if source.looks <= 0:
        ann.copy_of = None
    original = source.module()
    theirs = None if original is None else annotation_of(original, source.pname)
    if theirs is None or (theirs.recipe, theirs.dim) != (ann.recipe, ann.dim) or any(b is None for b in buffers):
        ann.copy_of = None
        return
    recipe, param = ann.recipe, module._parameters.get(pname)
    if param is None or param.is_meta:
        return
    state = [full(b) for b in buffers]
    problem = recipe.state_problem(full(param.detach()), *state, dim=ann.dim)
    if problem is None and recipe.clocked:
        step = recipe.state_names.index("step")
        held = original._buffers.get(theirs.buffer_names(source.pname)[step])
        if held is not None and not held.is_meta:
            mine, model = int(state[step]), int(full(held))
            if mine != model:
                problem = f"its step clock reads {mine} where the model it was copied from reads {model}"
    if problem is not None:
        ann.averaged = problem
        ann.copy_of = None
        found.append(f"{name} ({recipe}): {problem}")


def warn_if_averaged(found: list) -> None:
    if found:
        warnings.warn(
            "nmcompile: the recipe state of a copy of the model was written by something other than nmcompile, "
            "most likely averaged (torch.optim.swa_utils.AveragedModel(..., use_buffers=True) averages every "
            "buffer, masks and step clocks included): " + "; ".join(found[:4]) + (" ..." if len(found) > 4 else "")
            + ". The copy's forward uses that state. Masks and step clocks must be copied, never averaged: build "
            "the average with use_buffers=False (its buffers are then copied from the model at each update)",
            stacklevel=4,
        )
