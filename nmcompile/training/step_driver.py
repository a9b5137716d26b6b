"""Running recipe schedules on the user's optimizer steps, with no call in the user's code.

Recipes with a schedule (``step``, ``mdgf``, ``sdgf``, ``transposable``, ``bi_mask``) count
optimizer steps. While something that needs those counts is alive (a recipe record made by any
declaration route, a model compiled by the ``nmsparse`` backend with a scheduled recipe, or an
:class:`~nmcompile.training.optimizer_hook.OptimizerHook` from :func:`~nmcompile.training.hook_optimizer`), one :class:`StepDriver` holds PyTorch's
*global* optimizer step hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook``, public API; no
optimizer object or class is changed). They are removed when the last such owner is garbage
collected. On every ``step()`` of any ``torch.optim.Optimizer``, for the annotated weights of the
modules the driver watches that this optimizer updates:

1. before the step, each recipe's ``before_step`` sees its weights (STEP reads gradients and
   Adam's moments here, and in its second phase performs the frozen-moment update itself);
2. after the step, the ``step`` clock of every clocked weight advances by one and each recipe's
   ``after_step`` runs its schedule (refresh a mask every k steps, re-search a permutation).

An optimizer step that does not run (a gradient scaler skipping a step with inf gradients) counts
nothing, and gradient accumulation counts one per ``step()``. With ``step(closure)``, a closure that
the pre-step work needs (STEP's, the finite check's gradients) is evaluated before that work when the
optimizer evaluates it once (every ``torch.optim`` optimizer but LBFGS), and the step returns its
loss; the forwards of a closure evaluated several times (LBFGS) are known to run inside the step. A
weight with a schedule that a second optimizer steps with the gradient the first one used is refused
(it would count two steps per iteration). A ``copy.deepcopy`` of a watched module is watched too. The driver also names, once, each
declared weight that gets a gradient although no ``nmsparse`` graph has used it: a layer that
trains dense without a word is the failure this guards against. :func:`nmcompile.training.hook_optimizer` adds mask
diagnostics and a finite check for one optimizer; calling it again replaces its settings.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..state import records
from ..state.records import WeightAnnotation, state_dict_of
from ..state.clock import StepMirror
from .copy_checks import CopySource, look_at_copy, warn_if_averaged
from .step_checks import raise_if_not_finite, warn_if_never_compiled, warn_if_parametrized
from .step_closures import closure_first

__all__ = ["StepDriver", "Tracked", "driver"]


@dataclass
class Tracked:
    """One annotated weight as a recipe's optimizer-time code sees it."""

    name: str
    module: nn.Module
    param_name: str
    ann: WeightAnnotation
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # refreshed before every call
    step: int = 0  # the weight's clock after the step (clocked recipes)
    scratch: dict = field(default_factory=dict)  # per-step values a recipe passes from before to after

    @property
    def param(self) -> torch.Tensor:
        return self.module._parameters[self.param_name]

    def mirror(self, key: str) -> StepMirror:
        """A Python copy of the 0-d state tensor ``key`` (see :class:`nmcompile.state.clock.StepMirror`)."""
        return self.scratch.setdefault(("mirror", key), StepMirror())


@dataclass
class Settings:
    diagnostics_every: int = 0
    check_finite: bool = False


class _PerOptimizer:
    """What the driver keeps for one optimizer: its tracked weights and its step count."""

    def __init__(self) -> None:
        self.steps = 0
        self.tracked: dict[tuple, Tracked] = {}  # (id(module), param name, id(record)) -> Tracked
        self.groups: dict = {}  # recipe -> [Tracked] of the step in progress
        self.used: set = set()  # ids of the weights an nmsparse graph has used (see StepDriver._groups)
        self.averaged: list[str] = []  # copies' recipe state found averaged at this step (see copy_checks)
        self.mask_fns: dict = {}


class StepDriver:
    """Counts optimizer steps for the watched modules' recipes (see the module docstring)."""

    def __init__(self) -> None:
        self.watched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {param name: fqn}
        self.settings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> Settings
        self.optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _PerOptimizer
        # compiled module -> [plan, route, names already named or warned about] (options, NMSPARSE_RECIPE)
        self.plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # parameter -> (optimizer, gradient, its version) of the last step that advanced its clock
        self.last_step: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.closures: list[set[int]] = []  # ids of the parameters of each optimizer whose closure runs now
        ref = weakref.ref(self)
        handles = [
            register_optimizer_step_pre_hook(functools.partial(_call, ref, "before")),
            register_optimizer_step_post_hook(functools.partial(_call, ref, "after")),
        ]
        weakref.finalize(self, _remove, handles)

    def __reduce__(self):
        """A copied or unpickled record gets this process's live driver, not a copy of its hooks."""
        return (driver, ())

    def declare(self, root: nn.Module, plan, route: str, named: set) -> None:
        """``plan`` (from ``route``) applies to ``root``'s weights; ``named`` were reported already."""
        entry = self.plans.get(root)
        if entry is None or entry[0] != plan:
            self.plans[root] = [plan, route, set(named), False]  # last: checked at an optimizer step
        else:
            entry[2].update(named)

    def _plan_dense(self, optimizer) -> None:
        """Name weights a plan selects that train although no graph has given them a record.

        Each compiled module is looked at once, at the first step of an optimizer that updates its
        weights (a walk over the whole module would cost every step).
        """
        if not self.plans or all(entry[3] for entry in self.plans.values()):
            return
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        dense = []
        for root, entry in list(self.plans.items()):
            plan, route, named, checked = entry
            if checked or not any(id(p) in in_optimizer for p in root.parameters()):
                continue
            entry[3] = True
            for name, places in records.owners(root):
                _, module, pname = places[0]
                param = module._parameters[pname]
                if (param.dim() < 2 or name in named or id(param) not in in_optimizer or param.grad is None
                        or isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or len(places) > 1):
                    continue
                if records.get(module, records.RECIPES, pname) or records.get(module, records.DEPLOYED, pname):
                    continue
                recipe = plan.recipe_for(name, tuple(param.shape))
                if recipe is not None:
                    named.add(name)
                    dense.append(f"{name} ({recipe} from {route}, {type(module).__name__})")
        if dense:
            warnings.warn(
                f"nmcompile: {', '.join(dense[:6])}{' ...' if len(dense) > 6 else ''} are selected by the "
                "declaration but no nmsparse graph has used them, so this optimizer step trains them dense: "
                "Dynamo ran their layers outside every compiled graph (a layer it does not trace, such as "
                "nn.LSTM or nn.GRU, a graph break, or an FSDP2 unit of its own). Exclude them to keep them "
                "dense on purpose",
                stacklevel=3,
            )

    def watch(self, model: nn.Module) -> None:
        """Count steps for the annotated weights of ``model`` and its submodules."""
        for name, places in records.owners(model):
            _, module, pname = places[0]
            if records.get(module, records.RECIPES, pname) is not None:
                self.watch_module(module, pname, name)

    def watch_module(self, module: nn.Module, pname: str, name: str) -> None:
        names = self.watched.get(module)
        if names is None:
            names = self.watched[module] = {}
        names.setdefault(pname, name)

    def adopt_copy(self, ann: WeightAnnotation, memo: dict) -> None:
        """Watch the copy of the module that holds ``ann`` in a ``copy.deepcopy`` in progress (``memo``)."""
        key = "nmcompile: watched records"  # one walk over the watched modules per deepcopy
        holders = memo.get(key)
        if holders is None:
            holders = memo[key] = {
                id(record): (module, pname, names.get(pname, pname))
                for module, names in list(self.watched.items())
                for pname, record in records.table(module, records.RECIPES).items()
            }
        held = holders.get(id(ann))
        if held is not None and id(held[0]) in memo:
            self.watch_module(memo[id(held[0])], held[1], held[2])
            copied = memo.get(id(ann))
            if copied is not None:
                copied.copy_of = CopySource(held[0], held[1])

    def _groups(self, optimizer, per: _PerOptimizer, every_weight: bool) -> dict:
        """``{recipe: [Tracked]}`` of the weights this step has work for: those with a schedule, those
        no graph has used yet (see :func:`_warn_if_never_compiled`), and all with ``every_weight``
        (diagnostics, finite check). A weight without a schedule costs nothing per step after that."""
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        groups: dict = {}
        tracked = {}
        used = per.used = set()  # ids of the weights some nmsparse graph has used (tied holders share one)
        per.averaged = []
        for module, names in list(self.watched.items()):
            for pname, ann in list(records.table(module, records.RECIPES).items()):
                param = module._parameters.get(pname)
                if param is None:
                    warn_if_parametrized(module, pname, ann, names.get(pname, pname), in_optimizer)
                    continue
                records.refresh_if_replaced(module, pname, ann, names.get(pname, pname))
                if ann.consumed:
                    used.add(id(param))
                if not (every_weight or ann.recipe.clocked or not ann.consumed):
                    continue
                if id(param) not in in_optimizer:
                    if ann.copy_of is not None:  # a copy no optimizer steps (an EMA): a few looks at its state
                        look_at_copy(module, pname, ann, names.get(pname, pname), per.averaged)
                    continue
                ann.copy_of = None  # a copy an optimizer steps trains on its own: its state is its own
                key = (id(module), pname, id(ann))
                w = per.tracked.get(key) or Tracked(names.get(pname, pname), module, pname, ann)
                w.state = state_dict_of(module, pname, ann)
                tracked[key] = w
                groups.setdefault(ann.recipe, []).append(w)
        per.tracked = tracked
        return groups

    def updating(self, param: torch.Tensor) -> bool:
        """Whether ``param`` belongs to an optimizer whose step is evaluating its closure now (LBFGS
        changes the weights between the evaluations of one step)."""
        return any(id(param) in ids for ids in self.closures)

    def before(self, optimizer, args=(), kwargs=None):
        per = self.optimizers.get(optimizer)
        if per is None:
            per = self.optimizers[optimizer] = _PerOptimizer()
        settings = self.settings.get(optimizer)
        with torch.no_grad():
            every_weight = settings is not None and bool(settings.check_finite or settings.diagnostics_every)
            per.groups = self._groups(optimizer, per, every_weight)
        checks = settings is not None and settings.check_finite
        evaluated = False
        if per.groups:
            args, kwargs, evaluated = closure_first(self, optimizer, per.groups, checks, args, kwargs or {})
        with torch.no_grad():
            self._raise_if_counted(optimizer, per.groups)
            if checks:
                raise_if_not_finite(per.groups, per.steps + 1)
            warn_if_never_compiled(per.groups, per.used)
            warn_if_averaged(per.averaged)
            self._plan_dense(optimizer)
            for recipe, weights in per.groups.items():
                recipe.before_step(weights, optimizer)
        return (args, kwargs) if evaluated else None

    def _raise_if_counted(self, optimizer, groups) -> None:
        """Refuse a second optimizer's step on a clocked weight with the gradient another one used."""
        for recipe, weights in groups.items():
            if not recipe.clocked:
                continue
            for w in weights:
                last = self.last_step.get(w.param)
                grad = w.param.grad
                if last is None or grad is None or last[1]() is not grad or last[2] != grad._version:
                    continue
                other = last[0]()
                if other is not None and other is not optimizer:
                    raise ValueError(
                        f"nmcompile: {w.name!r} ({recipe}) is updated by two optimizers, "
                        f"{type(other).__name__} and then {type(optimizer).__name__}, from the same gradient, "
                        "so its schedule would count two optimizer steps per iteration. Give each annotated "
                        "weight to one optimizer (separate parameter groups of one optimizer can hold "
                        "different settings)"
                    )

    def after(self, optimizer) -> None:
        per = self.optimizers.get(optimizer)
        if per is None:
            return
        per.steps += 1
        settings = self.settings.get(optimizer)
        every = settings.diagnostics_every if settings is not None else 0
        record = every and per.steps % every == 0
        with torch.no_grad():
            for recipe, weights in per.groups.items():
                for w in weights:
                    w.step = w.ann.clock.advance(w.state["step"]) if recipe.clocked else per.steps
                recipe.after_step(weights, optimizer)
                if recipe.clocked:
                    for w in weights:
                        grad = w.param.grad
                        if grad is not None:
                            self.last_step[w.param] = (weakref.ref(optimizer), weakref.ref(grad), grad._version)
                if record:
                    mask_of = _mask_fn(per, recipe)
                    for w in weights:
                        w.ann.trace.record_mask(w.step, mask_of(w.param.detach(), tuple(w.state.values()), w.ann.dim))
        per.groups = {}


def _call(ref, what: str, optimizer, args, kwargs):
    driver = ref()
    if driver is not None:
        return getattr(driver, what)(optimizer, args, kwargs) if what == "before" else driver.after(optimizer)
    return None


def _remove(handles) -> None:
    for handle in handles:
        handle.remove()


_DRIVER: weakref.ref | None = None  # the live driver, while something holds it


def driver() -> StepDriver:
    """The process's step driver, created (and its global hooks registered) if none is alive.

    Callers keep the returned object for as long as they need steps counted; the hooks go when no
    one holds it any more.
    """
    global _DRIVER
    live = _DRIVER() if _DRIVER is not None else None
    if live is None:
        live = StepDriver()
        _DRIVER = weakref.ref(live)
    return live


def _mask_fn(per: _PerOptimizer, recipe):
    """``recipe.mask`` compiled (one fused pass over the weight instead of many eager ones)."""
    fn = per.mask_fns.get(recipe)
    if fn is None:
        fn = functools.partial(_mask_of, recipe)
        # a framed recipe reads its step clock as a Python int to pick the frame's pattern: compiled,
        # that is a graph break (and a warning) on every diagnostics record; eager, it is one read
        if not recipe.framed:
            fn = torch.compile(fn, dynamic=False)
        per.mask_fns[recipe] = fn
    return fn


def _mask_of(recipe, weight, state, dim):
    return recipe.mask(weight, *state, dim=dim)
