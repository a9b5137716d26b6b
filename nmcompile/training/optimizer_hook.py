"""``hook_optimizer``: mask diagnostics and a finite check on one optimizer's steps.

Schedules need no call: the step driver (:mod:`.step_driver`) counts optimizer steps for every
declared model. :func:`hook_optimizer` adds, for one optimizer, mask diagnostics every K steps and
a NaN/inf check before each step; it also makes an uncompiled (eager) annotated model count steps.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..state import records
from .step_driver import Settings, driver

__all__ = ["hook_optimizer", "OptimizerHook"]


class OptimizerHook:
    """The handle :func:`hook_optimizer` returns; ``remove()`` drops its settings."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, diagnostics_every: int, check_finite: bool):
        self.driver = driver()
        self.driver.watch(model)
        self.model, self.optimizer = model, optimizer
        self.driver.settings[optimizer] = Settings(diagnostics_every, check_finite)
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
    :mod:`nmcompile.training.step_driver`). This also makes a model that is not compiled (eager use of an
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
    _raise_if_not_its_optimizer(model, optimizer)
    return OptimizerHook(model, optimizer, diagnostics_every, check_finite)


def _raise_if_not_its_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that updates none of ``model``'s annotated weights (or, before any record
    exists, none of its parameters): its diagnostics and finite check would look at nothing."""
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    declared, shared = [], False
    for name, places in records.owners(model):
        _, module, pname = places[0]
        if id(module._parameters[pname]) in in_optimizer:
            shared = True
            if records.get(module, records.RECIPES, pname) is not None:
                return
        elif records.get(module, records.RECIPES, pname) is not None:
            declared.append(name)
    if declared or not shared:
        what = f"annotated weights ({', '.join(declared[:4])}{' ...' if len(declared) > 4 else ''})" if declared \
            else "parameters"
        raise ValueError(
            f"hook_optimizer: the {type(optimizer).__name__} updates none of the model's {what}, so its "
            "diagnostics and finite check would look at nothing; pass the optimizer built from this model's "
            "parameters (e.g. torch.optim.AdamW(model.parameters()))"
        )
