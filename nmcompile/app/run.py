"""One training run with a recipe through ``torch.compile(..., backend="nmsparse")``, recorded as JSON.

:func:`train_run` is shared by ``nmcompile demo`` and ``benchmarks/quality/quality.py``: it annotates the
model, compiles it, trains it with AdamW (with :func:`nmcompile.hook_optimizer` for the mask
diagnostics; schedules count the steps by themselves) at a constant learning rate or with warmup then
cosine decay (:func:`lr_at`), evaluates it every ``eval_every`` steps, and returns a JSON-ready record: the loss
and evaluation curves, per-layer flip rate / SAD / STEP statistics, the final per-layer sparsity,
timings, and the model (for finalizing and export).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from ..declare.annotate import annotate
from ..training.optimizer_hook import hook_optimizer
from .progress import Progress
from ..recipes import parse
from .report import model_record
from ..recipes import RECIPES

__all__ = ["train_run", "with_total_steps", "lr_at", "SCHEDULES"]

SCHEDULES = ("constant", "cosine")


def with_total_steps(spec: str, steps: int) -> str:
    """``spec`` with ``total_steps=steps`` added when its recipe has that key and the spec omits it."""
    recipe = spec.split(",")[0].split(":")[0]

    cls = RECIPES.get(recipe)
    fields = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    if "total_steps" in fields and "total_steps=" not in spec:
        return f"{spec},total_steps={steps}"
    return spec


def lr_at(step: int, steps: int, lr: float, schedule: str = "constant", warmup: float = 0.05) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``steps``. ``constant``: ``lr``.
    ``cosine``: linear warmup over the first ``w = round(warmup * steps)`` steps,
    ``lr * (step + 1) / w``, then half a cosine from ``lr`` towards 0 at ``steps``:
    ``lr * (1 + cos(pi * (step - w) / (steps - w))) / 2``."""
    if schedule == "constant":
        return lr
    w = round(warmup * steps)
    if step < w:
        return lr * (step + 1) / w
    return lr * (1 + math.cos(math.pi * (step - w) / max(steps - w, 1))) / 2


def _rules(recipe, steps: int):
    """``recipe`` (a spec or a ``{glob: spec}`` mapping, first match wins) with ``total_steps`` filled in."""
    if isinstance(recipe, str):
        spec = with_total_steps(recipe, steps)
        parse(spec)
        return spec
    rules = {glob: with_total_steps(spec, steps) for glob, spec in recipe.items()}
    for spec in rules.values():
        if spec.strip().lower() not in ("dense", "none"):
            parse(spec)
    return rules


def train_run(
    model: nn.Module,
    recipe: str | dict[str, str] | None,
    batches: Callable[[int], tuple],
    loss_fn: Callable,
    evaluate: Callable[[Callable], float],
    *,
    steps: int,
    lr: float = 3e-3,
    exclude=None,
    eval_every: int = 100,
    diagnostics_every: int = 10,
    max_seconds: float | None = None,
    label: str = "",
    progress: bool = True,
    inner: str = "inductor",
    schedule: str = "constant",
    warmup: float = 0.05,
    eval_first: bool = False,
    distill=None,
) -> dict:
    """Train ``model`` for ``steps`` AdamW steps (``recipe`` None: dense, compiled by Inductor).

    ``batches(step)`` gives ``(inputs, targets)``; ``loss_fn(outputs, targets)`` the loss;
    ``evaluate(forward)`` a metric computed with the compiled model in eval mode. ``recipe`` may be
    ``{glob: spec}`` rules (first match wins, ``"dense"`` keeps a weight dense), e.g. to name a layer
    that ``"*"`` leaves out. ``schedule``: ``"constant"`` or ``"cosine"`` (warmup over the first
    ``warmup`` fraction of the steps, then cosine decay; see :func:`lr_at`). Stops early after
    ``max_seconds`` of training, counted from before the first step (so the compile is inside it) and
    checked after each step: the record's ``steps_run`` says how many ran and ``stopped`` why
    (``"time"``, or None when every step ran). ``eval_first``: evaluate after the first step too, so
    that the evaluation graph compiles at the start, inside the time checks, not after the last step.
    ``first_step_seconds`` is the time to the end of the first step (and that evaluation). ``distill``: a
    :class:`~nmcompile.training.distill.Distillation` made for ``model``, whose loss (given ``loss_fn`` as its
    task loss) replaces ``loss_fn``'s.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"train_run: schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"train_run: warmup is a fraction of the steps in [0, 1), got {warmup!r}")
    record = {"recipe": recipe or "dense", "steps": steps, "lr": lr, "loss": [], "eval": []}
    if schedule != "constant":
        record.update(schedule=schedule, warmup=warmup)
    if recipe is not None:
        spec = _rules(recipe, steps)  # a bad recipe fails before any compile
        record["recipe"] = spec
        report = annotate(model, spec, exclude=exclude)
        record["annotated"] = sorted(report.annotated)
        # static shapes: training and evaluation batches differ, and framed schedules need static graphs
        compiled = torch.compile(model, backend="nmsparse", options={"inner": inner}, dynamic=False)
    else:
        compiled = torch.compile(model, backend="inductor" if inner == "inductor" else "aot_eager", dynamic=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if recipe is not None:
        hook_optimizer(model, optimizer, diagnostics_every=diagnostics_every)
    start = time.perf_counter()
    bar = Progress(steps, label, enabled=progress, deadline=None if max_seconds is None else start + max_seconds)
    done = 0
    record["stopped"] = None
    for step in range(steps):
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, schedule, warmup)
        inputs, targets = batches(step)
        loss = loss_fn(compiled(inputs), targets) if distill is None else distill(compiled, inputs, targets, loss_fn)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done = step + 1
        out_of_time = max_seconds is not None and time.perf_counter() - start > max_seconds
        last = done == steps or out_of_time
        if out_of_time and done < steps:
            record["stopped"] = "time"
        if done % 10 == 0 or last:
            value = loss.item()
            if not math.isfinite(value):
                raise FloatingPointError(f"{label or record['recipe']}: the loss is {value} at step {done}")
            record["loss"].append((done, value))
            bar.update(done, f"loss {value:.3f}")
        if done % eval_every == 0 or last or (eval_first and done == 1):
            model.eval()
            with torch.no_grad():
                record["eval"].append((done, float(evaluate(compiled))))
        if done == 1:
            record["first_step_seconds"] = time.perf_counter() - start
            if not last:
                bar.update(done, "compiled")  # the rate behind the ETA starts here, after the compiles
        if last:
            break
    bar.close(f"loss {record['loss'][-1][1]:.3f}" if record["loss"] else "")
    record["steps_run"] = done
    record["seconds"] = time.perf_counter() - start
    if recipe is not None:
        record.update(model_record(model))
    record["final_eval"] = record["eval"][-1][1] if record["eval"] else None
    return {"record": record, "model": model, "compiled": compiled}
