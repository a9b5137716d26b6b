"""What was declared against what the backend rewrote: nothing is left dense without a word.

At each compile of a graph the backend reports, in one warning per graph (``strict``: an error),
every declared weight it leaves dense with the reason, and a declaration that selects nothing;
a finalized model compiled into a training graph; and recipe state made at a first forward, which
a checkpoint loaded before it cannot have restored. It also hands the options or environment plan
to the step driver, which names the weights that plan selects but that train outside every graph.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import fx

from ..passes import PassContext
from ..passes.matching.sources import owning_module, parameter_fqn, parameter_placeholders, root_module
from ..state.records import deployed_of
from ..training.step_driver import driver as step_driver

__all__ = ["report", "fresh_state_message", "warn_if_trained", "warn_if_mixed", "declare_plan", "Holding"]

log = logging.getLogger("nmcompile")


def fresh_state_message(slots) -> str:
    """Why weights whose recipe state is created at their first forward cannot resume that state.

    State is made lazily for a weight declared through options, NMSPARSE_RECIPE or a region. A
    checkpoint loaded before that forward (the Trainer's resume_from_checkpoint, load_state_dict)
    found no ``<param>_nm_<key>`` buffers to load into, and dropped those entries as unexpected.
    """
    routes = {"options": "the backend options", "region": "nmcompile.region"}
    names = [f"{slot.fqn} ({slot.recipe} from {routes.get(slot.origin, slot.origin)})" for slot in slots]
    shown = "; ".join(names[:4]) + (f"; and {len(names) - 4} more" if len(names) > 4 else "")
    origins = {slot.origin for slot in slots}
    if origins == {"NMSPARSE_RECIPE"}:
        fix = "nmcompile.annotate(model, os.environ['NMSPARSE_RECIPE'])"  # same strings and TOML paths
    elif origins == {"options"}:
        fix = f"nmcompile.annotate(model, {str(slots[0].recipe)!r}) with the options' include/exclude"
    else:
        fix = "nmcompile.annotate(model, {weight name: recipe, ...})"
    return (
        f"nmsparse: recipe state for {len(slots)} weight(s) is created at their first forward and starts fresh "
        f"from the weights as they are now: {shown}. If a checkpoint was loaded into this model before this "
        "forward (Trainer.train(resume_from_checkpoint=...), load_state_dict(strict=False)), that state was not "
        "restored from it (its <param>_nm_<key> entries were dropped as unexpected keys), so the resumed run does "
        "not continue the saved one. To save and restore recipe state, declare the recipe before building the "
        f"Trainer or loading: {fix}, then compile as before"
    )


def report(ctx: PassContext, strict: bool) -> None:
    """One summary per graph of what was declared and left dense (``strict``: an error instead)."""
    for t in ctx.targets:
        log.info("nmsparse: %s <- %s (from %s)", t.fqn, t.recipe, t.origin)
    for ann, reason in ctx.named:  # named here: the step driver does not name them again
        ann.named = reason
    if ctx.by_default:
        # default behaviour, not a problem (strict does not raise), but said: the rule read "every weight"
        shown = "".join(f"\n  {name}: {reason}" for name, reason in ctx.by_default.items())
        warnings.warn(f"nmsparse:{shown}", stacklevel=3)
    problems = [f"\n  {name}: {reason}" for name, reason in ctx.skipped.items()]
    for origin, plan in (("options", ctx.options_plan), ("NMSPARSE_RECIPE", ctx.env_plan)):
        if plan is not None and ctx.weights and not ctx.targets:
            why = plan.why_none(ctx.weights)
            if why is not None:
                shown = ", ".join(ctx.weights[:3]) + (", ..." if len(ctx.weights) > 3 else "")
                problems.append(f"\n  the {origin} declaration selects none of the {len(ctx.weights)} weights "
                                f"of this graph ({shown}): {why}")
            break  # the options route hides the environment's
    if problems:
        message = "nmsparse left these weights dense:" + "".join(problems)
        if strict:
            raise ValueError(message + "\n(strict=True; fix the declaration or exclude these weights)")
        warnings.warn(message, stacklevel=3)
    elif not ctx.targets and ctx.candidates and not ctx.declared:
        warnings.warn(
            f"nmsparse: no N:M recipe is declared for any of {len(ctx.candidates)} weights "
            f"({', '.join(ctx.candidates[:3])}{', ...' if len(ctx.candidates) > 3 else ''}); training dense. "
            "Declare one with nmcompile.annotate, options={'recipe': ...}, NMSPARSE_RECIPE or nmcompile.region; "
            "for a finalized checkpoint loaded into a fresh model, nmcompile.finalize(model, pattern='2:4') "
            "records its N:M weights for the deploy kernels",
            stacklevel=3,
        )


def warn_if_trained(ctx: PassContext, strict: bool) -> None:
    """Finalized weights in a graph that computes their gradients would train dense: say so."""
    if not torch.is_grad_enabled():
        return
    trained = [t.fqn for t in ctx.deployed if t.param.requires_grad]
    if not trained:
        return
    message = (
        f"nmsparse: the finalized N:M weights {', '.join(trained[:4])}{' ...' if len(trained) > 4 else ''} are in "
        "a graph that computes their gradients, and nothing keeps their pattern: an optimizer step would update "
        "them dense. To fine-tune and keep the pattern, declare a recipe for them, e.g. "
        "nmcompile.annotate(model, 'asp:2:4,permute=False') (its mask keeps the current zeros); for inference, "
        "run under torch.no_grad() or torch.inference_mode(), or call requires_grad_(False)"
    )
    if strict:
        raise ValueError(message)
    warnings.warn(message, stacklevel=3)


def warn_if_mixed(gm: fx.GraphModule, strict: bool) -> None:
    """Finalized weights in a graph that also trains recipes run dense there: say so."""
    owned = [(parameter_fqn(src), owning_module(src, p)) for _, p, src in parameter_placeholders(gm)]
    finalized = [fqn for fqn, o in owned if o is not None and deployed_of(*o) is not None]
    if not finalized:
        return
    message = (
        f"nmsparse: {', '.join(finalized)} are finalized but this graph also trains recipes, so they run dense; "
        "the deploy kernels apply to a graph whose weights are all finalized or dense"
    )
    if strict:
        raise ValueError(message)
    warnings.warn(message, stacklevel=3)


def declare_plan(gm: fx.GraphModule, ctx: PassContext):
    """Give the step driver the options or environment plan and the module it applies to.

    Layers that Dynamo runs outside every graph (``nn.LSTM``, a graph break, an FSDP2 unit of its
    own) never reach the passes; at the first optimizer step that trains such a weight the plan
    selects, the driver names it. Returns the driver (the compiled graph holds it), or None.
    """
    routes = [(o, p) for o, p in (("options", ctx.options_plan), ("NMSPARSE_RECIPE", ctx.env_plan)) if p is not None]
    params = list(parameter_placeholders(gm))
    if not routes or not params:
        return None
    root = root_module(params[0][2])
    if root is None:
        return None

    live = step_driver()
    live.declare(root, routes[0][1], routes[0][0], set(ctx.skipped))
    return live


class Holding:
    """A compiled graph that keeps the step driver alive while it lives."""

    __slots__ = ("compiled", "driver")

    def __init__(self, compiled, driver):
        self.compiled, self.driver = compiled, driver

    def __call__(self, *args):
        return self.compiled(*args)
