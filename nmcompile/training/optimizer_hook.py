"""Running recipe schedules on the user's optimizer steps, with no call in the user's code.

Recipes with a schedule (``step``, ``mdgf``, ``sdgf``, ``transposable``, ``bi_mask``) count
optimizer steps. While something that needs those counts is alive (a recipe record made by any
declaration route, a model compiled by the ``nmsparse`` backend with a scheduled recipe, or an
:class:`OptimizerHook` from :func:`hook_optimizer`), one :class:`StepDriver` holds PyTorch's
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
nothing, and gradient accumulation counts one per ``step()``. The driver also names, once, each
declared weight that gets a gradient although no ``nmsparse`` graph has used it: a layer that
trains dense without a word is the failure this guards against. :func:`hook_optimizer` adds mask
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
from torch.nn.utils import parametrize

from ..state import records
from ..state.records import WeightAnnotation, state_dict_of
from ..state.clock import StepMirror

__all__ = ["hook_optimizer", "OptimizerHook", "StepDriver", "Tracked", "driver"]


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
class _Settings:
    diagnostics_every: int = 0
    check_finite: bool = False


class _PerOptimizer:
    """What the driver keeps for one optimizer: its tracked weights and its step count."""

    def __init__(self) -> None:
        self.steps = 0
        self.tracked: dict[tuple, Tracked] = {}  # (id(module), param name, id(record)) -> Tracked
        self.groups: dict = {}  # recipe -> [Tracked] of the step in progress
        self.used: set = set()  # ids of the weights an nmsparse graph has used (see StepDriver._groups)
        self.mask_fns: dict = {}


class StepDriver:
    """Counts optimizer steps for the watched modules' recipes (see the module docstring)."""

    def __init__(self) -> None:
        self.watched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {param name: fqn}
        self.settings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Settings
        self.optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _PerOptimizer
        # compiled module -> [plan, route, names already named or warned about] (options, NMSPARSE_RECIPE)
        self.plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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
                recipe = plan.recipe_for(name)
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

    def _groups(self, optimizer, per: _PerOptimizer, every_weight: bool) -> dict:
        """``{recipe: [Tracked]}`` of the weights this step has work for: those with a schedule, those
        no graph has used yet (see :func:`_warn_if_never_compiled`), and all with ``every_weight``
        (diagnostics, finite check). A weight without a schedule costs nothing per step after that."""
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        groups: dict = {}
        tracked = {}
        used = per.used = set()  # ids of the weights some nmsparse graph has used (tied holders share one)
        for module, names in list(self.watched.items()):
            for pname, ann in list(records.table(module, records.RECIPES).items()):
                param = module._parameters.get(pname)
                if param is None:
                    _warn_if_parametrized(module, pname, ann, names.get(pname, pname), in_optimizer)
                    continue
                records.refresh_if_replaced(module, pname, ann, names.get(pname, pname))
                if ann.consumed:
                    used.add(id(param))
                if not (every_weight or ann.recipe.clocked or not ann.consumed):
                    continue
                if id(param) not in in_optimizer:
                    continue
                key = (id(module), pname, id(ann))
                w = per.tracked.get(key) or Tracked(names.get(pname, pname), module, pname, ann)
                w.state = state_dict_of(module, pname, ann)
                tracked[key] = w
                groups.setdefault(ann.recipe, []).append(w)
        per.tracked = tracked
        return groups

    def before(self, optimizer) -> None:
        per = self.optimizers.get(optimizer)
        if per is None:
            per = self.optimizers[optimizer] = _PerOptimizer()
        settings = self.settings.get(optimizer)
        with torch.no_grad():
            every_weight = settings is not None and bool(settings.check_finite or settings.diagnostics_every)
            per.groups = self._groups(optimizer, per, every_weight)
            if settings is not None and settings.check_finite:
                _raise_if_not_finite(per.groups, per.steps + 1)
            _warn_if_never_compiled(per.groups, per.used)
            self._plan_dense(optimizer)
            for recipe, weights in per.groups.items():
                recipe.before_step(weights, optimizer)

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
                if record:
                    mask_of = _mask_fn(per, recipe)
                    for w in weights:
                        w.ann.trace.record_mask(w.step, mask_of(w.param.detach(), tuple(w.state.values()), w.ann.dim))
        per.groups = {}


def _call(ref, what: str, optimizer, *args) -> None:
    driver = ref()
    if driver is not None:
        getattr(driver, what)(optimizer)


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


def _warn_if_parametrized(module: nn.Module, pname: str, ann: WeightAnnotation, name: str, in_optimizer) -> None:
    """Name (once) a declared weight that a parametrization registered after the declaration now computes."""
    if ann.named is not None or not parametrize.is_parametrized(module, pname):
        return
    original = module.parametrizations[pname].original
    if id(original) not in in_optimizer or original.grad is None:
        return
    ann.named = records.parametrized_reason(name, ann.recipe)
    warnings.warn(f"nmcompile: {ann.named}; this optimizer step trains it dense", stacklevel=4)


def _warn_if_never_compiled(groups, used=frozenset()) -> None:
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


def _raise_if_not_finite(groups, step: int) -> None:
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


class OptimizerHook:
    """The handle :func:`hook_optimizer` returns; ``remove()`` drops its settings."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, diagnostics_every: int, check_finite: bool):
        self.driver = driver()
        self.driver.watch(model)
        self.model, self.optimizer = model, optimizer
        self.driver.settings[optimizer] = _Settings(diagnostics_every, check_finite)
        # the optimizer keeps the driver alive while hooked (its hook does nothing else)
        self._handle = optimizer.register_step_pre_hook(functools.partial(_hold, self.driver))

    @property
    def steps(self) -> int:
        """Optimizer steps the driver has counted for this optimizer."""
        per = self.driver.optimizers.get(self.optimizer)
        return per.steps if per is not None else 0

    def remove(self) -> None:
        self.driver.settings.pop(self.optimizer, None)
        self._handle.remove()


def _hold(driver, optimizer, args, kwargs) -> None:
    """Does nothing: registered on a hooked optimizer so that it holds ``driver``."""


def hook_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, diagnostics_every: int = 0, check_finite: bool = False
) -> OptimizerHook:
    """Record mask diagnostics, or check weights for NaN/inf, on ``optimizer``'s steps.

    Schedules need no call: the ``nmsparse`` backend counts optimizer steps by itself (see
    :mod:`nmcompile.training.optimizer_hook`). This also makes a model that is not compiled (eager use of an
    annotated model) count steps. Calling it again for the same optimizer replaces the settings;
    every step is still counted once.

    Args:
        model: the annotated (or compiled) model whose weights ``optimizer`` updates.
        optimizer: any ``torch.optim.Optimizer`` (STEP needs ``Adam`` or ``AdamW``).
        diagnostics_every: record flip rate and SAD every this many steps (0, the default: never;
            each record computes every weight's mask once more, see docs/benchmarks.md).
        check_finite: before each step, raise ``FloatingPointError`` naming the annotated weight and
            the step when its value or gradient holds NaN or inf; the step is not taken. Off by
            default: it reads every gradient once more and waits for the device each step.

    Returns:
        An :class:`OptimizerHook`; ``.remove()`` drops these settings.
    """
    if isinstance(model, torch.optim.Optimizer) and isinstance(optimizer, nn.Module):
        raise TypeError("hook_optimizer takes (model, optimizer), in that order")
    if not isinstance(model, nn.Module):
        raise TypeError(f"hook_optimizer: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"hook_optimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(diagnostics_every, bool) or not isinstance(diagnostics_every, int) or diagnostics_every < 0:
        raise ValueError(f"hook_optimizer: diagnostics_every must be an int >= 0, got {diagnostics_every!r}")
    if not isinstance(check_finite, bool):
        raise TypeError(f"hook_optimizer: check_finite must be True or False, got {check_finite!r}")
    return OptimizerHook(model, optimizer, diagnostics_every, check_finite)
