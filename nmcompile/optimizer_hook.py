"""Connecting recipe schedules to the user's optimizer through its hook API.

``nmcompile.hook_optimizer(model, optimizer)`` registers a step pre-hook and post-hook on the
optimizer (``Optimizer.register_step_pre_hook``/``register_step_post_hook``; the optimizer object
and its class are left as they are). On every ``optimizer.step()``:

1. before the step, each recipe's ``before_step`` sees its weights (STEP reads gradients and
   Adam's moments here, and in its second phase performs the frozen-moment update itself);
2. after the step, the ``step`` clock of every clocked weight advances by one, each recipe's
   ``after_step`` runs its schedule (refresh a mask every k steps, re-search a permutation), and
   the mask diagnostics are recorded every ``diagnostics_every`` steps.

Schedules therefore run on optimizer steps: gradient accumulation does not speed them up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from .annotate import ATTR, WeightAnnotation, _owners, state_dict_of
from .clock import StepMirror

__all__ = ["hook_optimizer", "OptimizerHook", "Tracked"]


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
        """A Python copy of the 0-d state tensor ``key`` (see :class:`nmcompile.clock.StepMirror`)."""
        return self.scratch.setdefault(("mirror", key), StepMirror())


class OptimizerHook:
    """The handle :func:`hook_optimizer` returns; ``remove()`` detaches it."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, diagnostics_every: int, check_finite: bool = False):
        self.model, self.optimizer, self.diagnostics_every = model, optimizer, diagnostics_every
        self.check_finite = check_finite
        self.steps = 0  # optimizer steps seen by this hook
        self._key: tuple | None = None
        self._groups: dict = {}
        self._mask_fns: dict = {}  # recipe -> its mask function, compiled by Inductor
        self._handles = [
            optimizer.register_step_pre_hook(self._before),
            optimizer.register_step_post_hook(self._after),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def tracked(self) -> dict:
        """``{recipe: [Tracked, ...]}`` for the annotated weights the optimizer updates."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        key = tuple(id(getattr(p, ATTR, None)) for p in params)
        if key != self._key:  # annotations appeared (first forward of an options route) or changed
            in_optimizer = {id(p) for p in params}
            groups: dict = {}
            for name, places in _owners(self.model):
                _, module, pname = places[0]
                param = module._parameters[pname]
                ann = getattr(param, ATTR, None)
                if ann is not None and id(param) in in_optimizer:
                    groups.setdefault(ann.recipe, []).append(Tracked(name, module, pname, ann))
            self._key, self._groups = key, groups
        for weights in self._groups.values():
            for w in weights:
                w.state = state_dict_of(w.module, w.param_name, w.ann)
        return self._groups

    def _before(self, optimizer, args, kwargs) -> None:
        with torch.no_grad():
            groups = self.tracked()
            if self.check_finite:
                self._raise_if_not_finite(groups)
            for recipe, weights in groups.items():
                recipe.before_step(weights, optimizer)

    def _raise_if_not_finite(self, groups) -> None:
        """Name the first annotated weight whose value or gradient holds NaN or inf (before the step runs)."""
        step = self.steps + 1
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

    def _after(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        record = self.diagnostics_every and self.steps % self.diagnostics_every == 0
        with torch.no_grad():
            for recipe, weights in self._groups.items():
                for w in weights:
                    w.step = w.ann.clock.advance(w.state["step"]) if recipe.clocked else self.steps
                recipe.after_step(weights, optimizer)
                if record:
                    mask_of = self._mask_fn(recipe)
                    for w in weights:
                        w.ann.trace.record_mask(w.step, mask_of(w.param.detach(), tuple(w.state.values()), w.ann.dim))

    def _mask_fn(self, recipe):
        """``recipe.mask`` compiled (one fused pass over the weight instead of many eager ones)."""
        fn = self._mask_fns.get(recipe)
        if fn is None:
            fn = self._mask_fns[recipe] = torch.compile(functools.partial(_mask_of, recipe), dynamic=False)
        return fn


def _mask_of(recipe, weight, state, dim):
    return recipe.mask(weight, *state, dim=dim)


def hook_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, diagnostics_every: int = 0, check_finite: bool = False
) -> OptimizerHook:
    """Run the recipes' schedules and diagnostics on ``optimizer``'s steps.

    Needed by recipes with a schedule (``step``, ``mdgf``, ``sdgf``, ``transposable``, ``bi_mask``);
    harmless for the others, for which it records diagnostics. Call it once, after creating the
    optimizer; the compiled model raises if such a recipe trains without it.

    Args:
        model: the annotated (or compiled) model whose weights ``optimizer`` updates.
        optimizer: any ``torch.optim.Optimizer`` (STEP needs ``Adam`` or ``AdamW``).
        diagnostics_every: record flip rate and SAD every this many steps (0, the default: never;
            each record computes every weight's mask once more, see docs/benchmarks.md).
        check_finite: before each step, raise ``FloatingPointError`` naming the annotated weight and
            the step when its value or gradient holds NaN or inf; the step is not taken. Off by
            default: it reads every gradient once more and waits for the device each step.

    Returns:
        An :class:`OptimizerHook`; ``.remove()`` detaches it.
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
