"""``optimizer.step(closure)`` as the step driver sees it: the closure evaluated before the pre-step
work that reads its gradients, or marked as running inside the step (LBFGS)."""

from __future__ import annotations

import functools

import torch

__all__ = ["closure_first"]


def closure_first(driver, optimizer, groups, checks: bool, args, kwargs):
    """``(args, kwargs, replaced)`` for ``optimizer.step(closure)``.

    The pre-step work reads this step's gradients (STEP's statistic and its own update, the finite
    check), but a closure computes them inside the step, after the pre-step hook. For
    ``torch.optim`` optimizers that evaluate the closure once, first thing in ``step()`` (all but
    LBFGS), it is evaluated here and the step gets a closure that returns the same loss, so
    ``step(closure)`` trains exactly as ``backward(); step()``. Any other closure is wrapped so
    that the compiled forwards it runs know the weights change inside an optimizer step.
    """
    closure, where = (args[1], 1) if len(args) > 1 else (kwargs.get("closure"), None)
    if closure is None:
        return args, kwargs, False
    reads = checks or any(recipe.reads_gradients for recipe in groups)
    if reads and _evaluates_closure_once(optimizer):
        with torch.enable_grad():
            loss = closure()
        replacement = functools.partial(_evaluated, loss)
    elif reads and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            f"nmcompile: {type(optimizer).__name__}.step(closure) is not torch.optim's own step, so nmcompile "
            "cannot tell when it computes the gradients that its pre-step work reads (STEP's statistic and "
            "update, check_finite); call loss.backward() and then optimizer.step() without a closure"
        )
    else:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        replacement = functools.partial(_in_step, driver, ids, closure)
    if where is None:
        return args, {**kwargs, "closure": replacement}, True
    return (*args[:1], replacement, *args[2:]), kwargs, True


def _evaluates_closure_once(optimizer) -> bool:
    """Whether ``optimizer.step`` is a ``torch.optim`` step that calls its closure once, before it reads
    any gradient (every torch.optim optimizer but LBFGS)."""
    step = type(optimizer).step
    step = getattr(step, "__wrapped__", step)
    module = getattr(step, "__module__", "") or ""
    return module.startswith("torch.optim.") and not isinstance(optimizer, torch.optim.LBFGS)


def _evaluated(loss):
    return loss


def _in_step(driver, ids: set, closure):
    driver.closures.append(ids)
    try:
        return closure()
    finally:
        driver.closures.remove(ids)
