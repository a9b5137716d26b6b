"""One training run with a recipe through ``torch.compile(..., backend="nmsparse")``, recorded as JSON.

:func:`train_run` is shared by ``nmcompile demo`` and ``benchmarks/quality.py``: it annotates the
model, compiles it, trains it with AdamW (with :func:`nmcompile.hook_optimizer` for the mask
diagnostics; schedules count the steps by themselves), evaluates it every ``eval_every`` steps, and returns a JSON-ready record: the loss
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

__all__ = ["train_run", "with_total_steps"]


def with_total_steps(spec: str, steps: int) -> str:
    """``spec`` with ``total_steps=steps`` added when its recipe has that key and the spec omits it."""
    recipe = spec.split(",")[0].split(":")[0]
    from ..recipes import RECIPES

    cls = RECIPES.get(recipe)
    fields = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    if "total_steps" in fields and "total_steps=" not in spec:
        return f"{spec},total_steps={steps}"
    return spec


def train_run(
    model: nn.Module,
    recipe: str | None,
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
) -> dict:
    """Train ``model`` for ``steps`` AdamW steps (``recipe`` None: dense, compiled by Inductor).

    ``batches(step)`` gives ``(inputs, targets)``; ``loss_fn(outputs, targets)`` the loss;
    ``evaluate(forward)`` a metric computed with the compiled model in eval mode. Stops early after
    ``max_seconds`` of training (the record says how many steps ran).
    """
    record = {"recipe": recipe or "dense", "steps": steps, "lr": lr, "loss": [], "eval": []}
    if recipe is not None:
        spec = with_total_steps(recipe, steps)
        parse(spec)  # a bad recipe fails before any compile
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
    bar = Progress(steps, label, enabled=progress)
    start = time.perf_counter()
    done = 0
    for step in range(steps):
        model.train()
        inputs, targets = batches(step)
        loss = loss_fn(compiled(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done = step + 1
        last = done == steps or (max_seconds is not None and time.perf_counter() - start > max_seconds)
        if done % 10 == 0 or last:
            value = loss.item()
            if not math.isfinite(value):
                raise FloatingPointError(f"{label or record['recipe']}: the loss is {value} at step {done}")
            record["loss"].append((done, value))
            bar.update(done, f"loss {value:.3f}")
        if done % eval_every == 0 or last:
            model.eval()
            with torch.no_grad():
                record["eval"].append((done, float(evaluate(compiled))))
        if last:
            break
    bar.close(f"loss {record['loss'][-1][1]:.3f}" if record["loss"] else "")
    record["steps_run"] = done
    record["seconds"] = time.perf_counter() - start
    if recipe is not None:
        record.update(model_record(model))
    record["final_eval"] = record["eval"][-1][1] if record["eval"] else None
    return {"record": record, "model": model, "compiled": compiled}
