"""Where declarations live: a table on each owning module, keyed by parameter name.

A recipe record (:class:`WeightAnnotation`) or a deploy record
(:class:`nmcompile.deploy.finalize.Deployed`) belongs to the module that owns the weight, under the
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
from collections.abc import Iterator
from typing import TYPE_CHECKING
from dataclasses import dataclass, field

import torch
from torch import nn

from .clock import StepMirror
from .sharding import full
from .trace import Trace

if TYPE_CHECKING:  # the records sit below the recipes: the type alone, for readers and checkers
    from ..recipes.base import Recipe

__all__ = ["RECIPES", "DEPLOYED", "table", "get", "put", "drop", "owners", "root", "WeightAnnotation",
           "annotation_of", "deployed_of", "state_of", "state_dict_of"]

RECIPES = "_nmcompile_recipes"  # {parameter attribute: WeightAnnotation}
DEPLOYED = "_nmcompile_deployed"  # {parameter attribute: Deployed}


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
    # the step driver, held while the record lives (see nmcompile.training.optimizer_hook)
    driver: object = field(default=None, compare=False, repr=False)
    # the kernels of its training GEMMs in the graph that last ran it (a kernels.train_dispatch.TrainKernels,
    # set by the backend; read by nmcompile.training.train_report)
    kernels: object = field(default=None, compare=False, repr=False)

    __hash__ = None  # mutable (pending); compare by (recipe, dim)

    def __deepcopy__(self, memo) -> WeightAnnotation:
        """A copy whose module (a ``copy.deepcopy`` of the model) the step driver watches as it does
        the original's: a copied model counts its steps and is named when it trains dense."""
        copied = copy.copy(self)
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            copied.__dict__[key] = copy.deepcopy(value, memo)
        adopt = getattr(copied.driver, "adopt_copy", None)
        if adopt is not None:
            adopt(self, memo)
        return copied

    def buffer_names(self, param_name: str) -> tuple[str, ...]:
        return tuple(f"{param_name}_nm_{key}" for key in self.recipe.state_names)


def annotation_of(module: nn.Module, param_name: str) -> WeightAnnotation | None:
    return get(module, RECIPES, param_name)


def deployed_of(module: nn.Module, param_name: str):
    """The weight's :class:`nmcompile.deploy.finalize.Deployed` record, or None."""
    return get(module, DEPLOYED, param_name)


def state_of(module: nn.Module, param_name: str, ann: WeightAnnotation) -> tuple[torch.Tensor, ...]:
    """The weight's state tensors, computed first if they are still pending (see :func:`settle`).

    Raises ``KeyError`` when a state buffer was removed.
    """
    if ann.pending:
        settle(module, param_name, ann)
    buffers = module._buffers
    return tuple(buffers[name] for name in ann.buffer_names(param_name))


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
    if ann.recipe.clocked:
        ann.clock.read(module._buffers[ann.buffer_names(pname)[ann.recipe.state_names.index("step")]])
