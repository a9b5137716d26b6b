"""Where declarations live: a table on each owning module, keyed by parameter name.

A recipe record (:class:`WeightAnnotation`) or a deploy record
(:class:`nmcompile.state.deployed.Deployed`) belongs to the module that owns the weight, under the
parameter's attribute name, never to the ``nn.Parameter`` object. Whatever replaces parameter
objects keeps the declaration by construction: FSDP2's ``fully_shard`` (before or after
``annotate``), ``to_empty`` after meta-device construction, ``load_state_dict(assign=True)``,
``copy.deepcopy``, pickling, wrappers that keep the module. The two tables are plain dicts in the
module's ``__dict__`` (attributes :data:`RECIPES` and :data:`DEPLOYED`), so every one of those
copies them with the module. A recipe's state tensors are buffers of the same module, named
``<param>_nm_<key>``.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING
from dataclasses import dataclass, field

import torch
from torch import nn

from .clock import StepMirror
from .sharding import full, is_sharded
from .trace import Trace

if TYPE_CHECKING:  # the records sit below the recipes: the type alone, for readers and checkers
    from ..recipes.base import Recipe

__all__ = ["RECIPES", "DEPLOYED", "INT8", "INT4", "table", "get", "put", "drop", "owners", "root", "WeightAnnotation",
           "annotation_of", "deployed_of", "state_of", "state_dict_of", "Seen", "replaced", "refresh", "refresh_if_replaced",
           "state_shape_differs", "parametrized_reason", "left_dense", "unpause"]

RECIPES = "_nmcompile_recipes"  # {parameter attribute: WeightAnnotation}
DEPLOYED = "_nmcompile_deployed"  # {parameter attribute: Deployed}
#: {parameter attribute: fp32 scales [*experts, out rows]}: a finalized weight a one-shot solve or a trained recipe
#: put on an int8 grid (``sparsegpt:2:4,bits=8``, ``asp:2:4,bits=8``), one scale per output row; read by ``pack_weights``
INT8 = "_nmcompile_int8"
#: a one-shot solve's or trained recipe's 4-bit grid of a weight (fp16 scales [out rows, in / group]), for pack_weights
INT4 = "_nmcompile_int4"


def table(module: nn.Module, kind: str) -> dict:
    """The module's records of ``kind`` (:data:`RECIPES` or :data:`DEPLOYED`); empty if none (read only)."""
    return module.__dict__.get(kind) or {}


def get(module: nn.Module, kind: str, param_name: str):
    return table(module, kind).get(param_name)


def put(module: nn.Module, kind: str, param_name: str, record) -> None:
    records = module.__dict__.get(kind)
    if records is None:
        records = {}
        object.__setattr__(module, kind, records)  # a plain attribute: nn.Module.__setattr__ would check it
    records[param_name] = record


def drop(module: nn.Module, kind: str, param_name: str):
    """Remove and return the record (or None)."""
    records = module.__dict__.get(kind)
    return records.pop(param_name, None) if records else None


def root(model: nn.Module) -> nn.Module:
    """``model`` without ``torch.compile``'s wrapper, so that names carry no ``_orig_mod.``."""
    while type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def owners(model: nn.Module) -> Iterator[tuple[str, list[tuple[str, nn.Module, str]]]]:
    """Each distinct parameter once, with every (module name, module, attribute) that holds it."""
    holders: dict[int, list[tuple[str, nn.Module, str]]] = {}
    seen: set[tuple[int, str]] = set()
    for mname, module in root(model).named_modules(remove_duplicate=False):
        for pname, param in module._parameters.items():
            if param is None or (id(module), pname) in seen:
                continue
            seen.add((id(module), pname))
            holders.setdefault(id(param), []).append((mname, module, pname))
    for places in holders.values():
        mname, _, pname = places[0]
        yield (f"{mname}.{pname}" if mname else pname), places


class Seen:
    """The parameter object a record's state was computed from (held weakly), or none known yet.

    A copied or unpickled record starts with none known: the first look takes the copy's own
    parameter (its state was computed from the same values).
    """

    __slots__ = ("ref",)

    def __init__(self) -> None:
        self.ref = None

    def __reduce__(self):
        return (Seen, ())

    def set(self, param) -> None:
        self.ref = None if param is None else weakref.ref(param)


@dataclass(eq=True)
class WeightAnnotation:
    """One weight's recipe record: the recipe, its grouping dim, and its run-time companions."""

    recipe: Recipe
    dim: int  # the grouping (reduction) dimension of the weight
    # run-time companions, not part of the declaration (excluded from equality):
    clock: StepMirror = field(default_factory=StepMirror, compare=False, repr=False)
    trace: Trace = field(default_factory=Trace, compare=False, repr=False)  # diagnostics
    pending: bool = field(default=False, compare=False)  # state not computed yet (meta weight)
    consumed: bool = field(default=False, compare=False)  # an nmsparse graph has run with it
    # the step driver, held while the record lives (see nmcompile.training.step_driver)
    driver: object = field(default=None, compare=False, repr=False)
    # the kernels of its training GEMMs in the graph that last ran it (a kernels.dispatch.train.TrainKernels,
    # set by the backend; read by nmcompile.training.train_report)
    kernels: object = field(default=None, compare=False, repr=False)

    # the parameter object its state was computed from (see :func:`replaced`)
    seen: Seen = field(default_factory=Seen, compare=False, repr=False)
    stale: bool = field(default=False, compare=False)  # the weight was replaced; its state was not recomputed
    # why the backend left it dense, once it said so (the step driver does not name it again)
    named: str | None = field(default=None, compare=False)
    # a copy's record (copy.deepcopy, e.g. an EMA): the record it was copied from, looked at a few times by
    # the step driver to find state averaged instead of copied (see nmcompile.training.copy_checks)
    copy_of: object = field(default=None, compare=False, repr=False)
    # what the step driver found averaged in this copy's recipe state (read by check and finalize)
    averaged: str | None = field(default=None, compare=False)
    # a copied or unpickled one-shot record: its token counts may hold a sequential finalize's pause (-1),
    # which the first look at its state clears (see state_of)
    copied: bool = field(default=False, compare=False)

    __hash__ = None  # mutable (pending); compare by (recipe, dim)

    def __deepcopy__(self, memo) -> WeightAnnotation:
        """A copy whose module (a ``copy.deepcopy`` of the model) the step driver watches as it does
        the original's: a copied model counts its steps and is named when it trains dense (no graph
        has run the copy's weights yet, whatever ran the original's)."""
        copied = copy.copy(self)
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            copied.__dict__[key] = copy.deepcopy(value, memo)
        copied.consumed = False  # no graph has run the copy yet: trained eagerly, it is named at its step
        copied.copy_of = None  # the driver links it to this record (adopt_copy)
        copied.copied = self.recipe.calibrated
        adopt = getattr(copied.driver, "adopt_copy", None)
        if adopt is not None:
            adopt(self, memo)
        return copied

    def __setstate__(self, state: dict) -> None:
        """Unpickled: a one-shot record's counts may hold a pause (see :func:`state_of`)."""
        self.__dict__.update(state)
        self.copied = self.recipe.calibrated

    def buffer_names(self, param_name: str) -> tuple[str, ...]:
        return tuple(f"{param_name}_nm_{key}" for key in self.recipe.state_names)


def left_dense(ann: WeightAnnotation) -> str | None:
    """Why a compiled graph left the declared weight dense (it trains dense and its forward uses the
    dense weight), when no ``nmsparse`` graph has run it rewritten; else None."""
    return ann.named if ann.named is not None and not ann.consumed else None


def annotation_of(module: nn.Module, param_name: str) -> WeightAnnotation | None:
    return get(module, RECIPES, param_name)


def deployed_of(module: nn.Module, param_name: str):
    """The weight's :class:`nmcompile.state.deployed.Deployed` record, or None."""
    return get(module, DEPLOYED, param_name)


def state_of(module: nn.Module, param_name: str, ann: WeightAnnotation) -> tuple[torch.Tensor, ...]:
    """The weight's state tensors, computed first if they are still pending (see :func:`settle`).

    Raises ``KeyError`` when a state buffer was removed.
    """
    if ann.pending:
        settle(module, param_name, ann)
    buffers = module._buffers
    state = tuple(buffers[name] for name in ann.buffer_names(param_name))
    if ann.copied and not ann.pending:
        unpause(ann, state)
    return state


def unpause(ann: WeightAnnotation, state: tuple[torch.Tensor, ...]) -> None:
    """Clear a pause (a token count of -1) a copy or checkpoint took during a sequential finalize.

    A sequential solve pauses the statistics of the blocks it is not calibrating by setting their
    counts to -1, and sets them back to 0 when it ends; a copy taken in between keeps the -1, which
    would make its calibration add nothing. A negative count is nothing else, so it is read as 0.
    """
    count = state[ann.recipe.state_names.index("count")] if "count" in ann.recipe.state_names else None
    if count is not None and not count.is_meta:
        with torch.no_grad(), torch.inference_mode(False):
            count.clamp_(min=0)
    ann.copied = False


def state_dict_of(module: nn.Module, param_name: str, ann: WeightAnnotation) -> dict[str, torch.Tensor]:
    """``{state key: tensor}`` of one annotated weight."""
    return dict(zip(ann.recipe.state_names, state_of(module, param_name, ann)))


def settle(module: nn.Module, pname: str, ann: WeightAnnotation) -> None:
    """Compute pending state from the weight once weight and buffers hold real values.

    A weight annotated on the meta device gets placeholder buffers and a pending record; its state
    is computed here, from the initialised weight, at the first use (a forward, ``state_dict()``).
    Buffers written since they were made (an in-place checkpoint load) keep what was written.
    """
    weight = module._parameters[pname]
    buffers = [module._buffers.get(name) for name in ann.buffer_names(pname)]
    if weight.is_meta or any(b is None or b.is_meta for b in buffers):
        return  # still a placeholder: the caller names the problem
    if not any(b._version for b in buffers if not b.is_inference()):
        with torch.no_grad(), torch.inference_mode(False):
            fresh = ann.recipe.init_state(full(weight.detach()), ann.dim)
            for key, buffer in zip(ann.recipe.state_names, buffers):
                buffer.copy_(fresh[key])
    ann.pending = False
    ann.seen.set(weight)
    if ann.recipe.clocked:
        ann.clock.read(module._buffers[ann.buffer_names(pname)[ann.recipe.state_names.index("step")]])


def replaced(module: nn.Module, pname: str, ann: WeightAnnotation) -> bool:
    """Whether ``module.<pname>`` is another ``nn.Parameter`` than the one ``ann``'s state came from.

    The first look at a record with none known (a new, copied or just loaded record) takes the
    current parameter. FSDP2's swaps between its sharded parameter and the unsharded one do not
    count, nor do plain tensors put in for one call (``torch.func.functional_call``).
    """
    param = module._parameters.get(pname)
    if param is None or ann.pending or param.is_meta:
        return False
    if ann.seen.ref is None:
        ann.seen.set(param)
        return False
    old = ann.seen.ref()
    if old is param:
        return False
    if is_sharded(param) or (old is not None and is_sharded(old)) or not isinstance(param, nn.Parameter):
        if is_sharded(param):  # fully_shard after the state was computed: the same values
            ann.seen.set(param)
        return False
    return True


def state_shape_differs(module: nn.Module, pname: str, ann: WeightAnnotation) -> bool:
    """Whether ``ann``'s state buffers have other shapes than the recipe makes for the weight now."""
    param = module._parameters.get(pname)
    if param is None or ann.pending or not ann.recipe.state_names:
        return False
    expected = ann.recipe.example_state(torch.empty(param.shape, dtype=param.dtype, device="meta"), ann.dim)
    held = [module._buffers.get(b) for b in ann.buffer_names(pname)]
    return any(b is not None and b.shape != expected[k].shape for b, k in zip(held, ann.recipe.state_names))


def refresh_if_replaced(module: nn.Module, pname: str, ann: WeightAnnotation, name: str) -> None:
    """Recipe state for a weight replaced by a new ``nn.Parameter`` after it was declared (see :func:`refresh`)."""
    if replaced(module, pname, ann):
        refresh(module, pname, ann, name)


def refresh(module: nn.Module, pname: str, ann: WeightAnnotation, name: str) -> None:
    """Recipe state for a weight that was replaced after it was declared.

    A recipe whose state is all computed from the weight's values (S-STE's beta, ASP's mask) gets
    it computed again from the new weight, as ``load_state_dict`` does, with a warning. A recipe
    with a schedule keeps its state (its step clock and optimizer history are not the weight's)
    and the warning says how to start it again; if the new weight has another shape, which that
    state cannot serve, it is an error saying the same.
    """
    param = module._parameters[pname]
    if set(ann.recipe.state_names) <= {"step"} and not state_shape_differs(module, pname, ann):
        ann.seen.set(param)
        return  # nothing was computed from the old weight (a step count goes on)
    recipe, keys = ann.recipe, ", ".join(ann.buffer_names(pname))
    again = (f"Call nmcompile.annotate(model, {str(recipe)!r}) again after replacing the weight to compute its "
             "state from the new one")
    fix = f"to set a weight's values and keep its state, copy them in place: with torch.no_grad(): {name}.copy_(values)"
    if recipe.clocked:
        if state_shape_differs(module, pname, ann):
            raise ValueError(
                f"nmcompile: {name} was replaced by a new nn.Parameter of shape {tuple(param.shape)} after it was "
                f"declared {recipe}; its state ({keys}) was made for the old weight's shape. {again} (its "
                "schedule starts over)"
            )
        ann.seen.set(param)
        ann.stale = True
        warnings.warn(
            f"nmcompile: {name} was replaced by a new nn.Parameter after it was declared {recipe}; its state "
            f"({keys}) was computed from the old weight and is kept, with its schedule. {again} (its schedule "
            f"starts over); {fix}",
            stacklevel=3,
        )
        return
    ann.seen.set(param)
    with torch.no_grad(), torch.inference_mode(False):
        fresh = recipe.init_state(full(param.detach()), ann.dim)
        for key, buffer in zip(recipe.state_names, ann.buffer_names(pname)):
            held = module._buffers.get(buffer)
            if held is not None and held.shape == fresh[key].shape:
                held.copy_(fresh[key])
            else:
                module._buffers[buffer] = fresh[key]
    warnings.warn(
        f"nmcompile: {name} was replaced by a new nn.Parameter after it was declared {recipe}; its state "
        f"({keys}) was computed again from the new weight, as load_state_dict does; {fix}",
        stacklevel=3,
    )


def parametrized_reason(name: str, recipe) -> str:
    """Why the declared weight ``name`` trains dense once a parametrization computes it, and the fixes."""
    module, _, tensor = name.rpartition(".")
    where = f"model.get_submodule({module!r})" if module else "model"
    return (
        f"{name} is declared {recipe}, but a parametrization was registered on it afterwards "
        "(torch.nn.utils.parametrize), and nmcompile sparsifies parameters, not a parametrization's output, so it "
        "trains dense. Remove the parametrization (torch.nn.utils.parametrize.remove_parametrizations("
        f"{where}, {tensor!r})), or drop the declaration to train it dense on purpose "
        f"(nmcompile.declare.annotate.detach_recipe({where}, {tensor!r}))"
    )
