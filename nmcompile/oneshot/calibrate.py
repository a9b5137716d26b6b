"""The one-shot part of :func:`nmcompile.finalize`: calibrate (one pass, or block by block) and solve.

:func:`solve_one_shot` runs the calibration the caller gave (batches, or a function that runs the
compiled model), chooses between one pass and the sequential form (:func:`calibration_form`), and
returns ``{name: Solved}`` (:mod:`nmcompile.oneshot.solve`) for ``finalize`` to bake. A recipe
declared through compile options, ``NMSPARSE_RECIPE`` or a region exists only once a compiled
forward has run: the calibration's first run declares it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn

from ..state import memory
from ..state.records import annotation_of, deployed_of, owners, state_of
from . import sequential as cached
from . import solve as oneshot
from .block_order import block_module, run_order
from .compute_dtype import compute_dtype, raised, stored_dtype, to_dtype

__all__ = ["solve_one_shot", "calibration_form"]


def solve_one_shot(model: nn.Module, calibration, sequential: bool | None, report,
                   options: dict | None, progress, asked_dtype: torch.dtype | None = None) -> dict:
    """``{name: Solved}`` of the one-shot weights (see :mod:`nmcompile.oneshot.solve`). Calibration
    batches run in :func:`nmcompile.oneshot.compute_dtype.compute_dtype`'s dtype (``asked_dtype``, else
    float32 for a bf16/fp16 model on a CPU without native arithmetic for it)."""
    batches = None
    if calibration is not None and not callable(calibration):
        if isinstance(calibration, (str, bytes, torch.Tensor)) or not isinstance(calibration, Iterable):
            raise TypeError(f"finalize(calibration=...) takes a list of calibration batches or a function of no "
                            f"arguments that runs the compiled model over them, got {type(calibration).__name__} "
                            "(one batch: pass [batch])")
        batches = list(calibration)
        if not batches:
            raise ValueError("finalize(calibration=[...]) got no batches: give at least one calibration batch")
    if sequential and calibration is None:
        raise ValueError("finalize(sequential=True) calibrates again before each block: pass calibration=batches "
                         "(a list of input batches) or calibration=fn, a function of no arguments that runs the "
                         "compiled model over the calibration batches")

    compute, why = compute_dtype(model, asked_dtype) if batches is not None else (stored_dtype(model), "")

    def run_batches():
        # aot_eager by default: no Inductor compile of the whole model for a one-time run
        compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager", **(options or {})})
        if progress is not None:
            progress(0, len(batches), "calibration batches")
        with torch.no_grad(), raised(model, compute):
            for k, batch in enumerate(batches):
                cached.run_batch(compiled, to_dtype(batch, compute))
                if progress is not None:
                    progress(k + 1, len(batches), f"batch {k + 1}")

    run = calibration if batches is None else run_batches
    declared_now = False
    if not oneshot.calibrated(model):
        if calibration is None:
            return {}
        if _finalized(model):  # finalize is idempotent: the weights were solved by an earlier call
            warnings.warn(f"nmcompile.finalize: {type(model).__name__} is already finalized (its one-shot weights were "
                          "solved before); the calibration was not run", stacklevel=3)
            return {}
        if _declared(model):
            raise ValueError(
                "finalize(calibration=...) is for one-shot recipes (wanda, sparsegpt), and no weight of "
                f"{type(model).__name__} is declared with one; finalize(model) without calibration bakes the recipes "
                "it is declared with")
        # compile options, NMSPARSE_RECIPE and regions declare at the first compiled forward: this run declares
        # the recipe and gathers the statistics (the one-pass form uses them; the sequential forms start over)
        run()
        declared_now = True
        if not oneshot.calibrated(model):
            raise ValueError(_undeclared_message(model, batches is not None))
    sequential, report.calibration = calibration_form(model, sequential, calibration is not None, compute)
    if compute != stored_dtype(model):
        report.calibration += f"; {why}"
    if declared_now:
        report.calibration += ("; the one-shot recipe was declared at the calibration's first compiled forward "
                               "(compile options, NMSPARSE_RECIPE or a region)")
    if sequential:
        solved = None
        if batches is not None:
            try:
                solved = cached.solve_cached(model, batches, options=options, progress=progress, compute=compute)
                report.calibration += "; each block ran alone on its cached inputs"
            except cached.Unchained as why:
                report.calibration += f"; the model ran again before each block ({why})"
        if solved is None:
            solved = oneshot.solve_sequential(model, run, _ran_order(model, run, report))
    else:
        if run is not None and not declared_now:  # (that run gathered the statistics already)
            run()
        solved = oneshot.solve(model, progress)
    for name, result in solved.items():
        if result.notes:
            report.fallbacks[name] = result.notes
    if report.fallbacks:
        warnings.warn("nmcompile.finalize: one-shot weights solved otherwise than from their statistics:\n  "
                      + "\n  ".join(note for notes in report.fallbacks.values() for note in notes), stacklevel=3)
    return solved


def _ran_order(model: nn.Module, run, report) -> list[list[str]]:
    """The one-shot blocks in the order the model runs them (see :mod:`nmcompile.oneshot.block_order`),
    named in ``report.calibration`` where it is not registration order; blocks the first forward did
    not run are warned about."""
    groups = oneshot.blocks([name for name, _, _ in oneshot.calibrated(model)])
    order, missing = run_order(model, groups, run)
    names = [block_module(model, group)[0] or group[0] for group in order]
    if order != groups:
        report.calibration += f"; blocks solved in the order the model ran them: {', '.join(names)}"
    if missing:
        note = (f"{', '.join(missing)} did not run in the model's first forward over the calibration batches, so "
                "the order they run in is not known: they are solved last, in registration order")
        report.calibration += f"; {note}"
        warnings.warn(f"nmcompile.finalize (sequential): {note}", stacklevel=4)
    return order


def calibration_form(model: nn.Module, sequential: bool | None, calibrating: bool,
                     compute: torch.dtype | None = None) -> tuple[bool, str]:
    """``(sequential, why)``: as asked, or (``None``) sequential when one pass's statistics, held twice
    (the one-pass graph copies them), plus the model raised to its ``compute`` dtype where that is
    wider than its own, would take more than half the memory available."""
    if not calibrating:
        return False, "from the statistics gathered before finalize"
    if sequential is not None:
        return sequential, ("sequential" if sequential else "one pass") + ", as asked"
    stats = sum(t.numel() * t.element_size() for _, places, ann in oneshot.calibrated(model)
                for t in state_of(places[0][1], places[0][2], ann)[:1])
    # one pass holds every statistic at once, and its aot_eager graph a copy of each mutated buffer:
    # Llama-3.2-1B shapes, 5.9 GB of statistics, peaked at 17.0 GB with the 2.5 GB model
    raised_bytes = 0 if compute is None else sum(p.numel() * compute.itemsize for p in model.parameters()
                                                 if p.is_floating_point() and p.dtype != compute)
    need, have = 2 * stats + raised_bytes, memory.available_bytes()
    gb = (f"{stats / 1e9:.2f} GB of statistics, held twice" + (f", and the model in {str(compute)[6:]} "
          f"({raised_bytes / 1e9:.2f} GB)" if raised_bytes else "") + f"; {have / 1e9:.1f} GB available")
    if need > have / 2:
        return True, f"sequential: one pass would hold every weight's statistics at once ({gb})"
    return False, f"one pass: every weight's statistics fit ({gb})"


def _finalized(model: nn.Module) -> bool:
    return any(deployed_of(*places[0][1:]) is not None for _, places in owners(model))


def _declared(model: nn.Module) -> bool:
    return any(annotation_of(*places[0][1:]) is not None for _, places in owners(model))


def _undeclared_message(model: nn.Module, batches: bool) -> str:
    name = type(model).__name__
    if batches:
        how = ("finalize compiled the model itself (torch.compile(model, backend='nmsparse', options="
               "calibration_options)) and ran the batches, and no weight got a one-shot recipe: the compile options of "
               "your own torch.compile call do not reach it. Pass the recipe to finalize's compile, "
               "calibration_options={'recipe': 'sparsegpt:2:4'}, declare it with nmcompile.annotate(model, "
               "'sparsegpt:2:4') before finalize, or pass calibration=fn, a function that runs your compiled model")
    else:
        how = ("calibration() ran, and no weight got a one-shot recipe: the function must run the model compiled with "
               "torch.compile(model, backend='nmsparse') and the recipe (options={'recipe': 'sparsegpt:2:4'}, "
               "NMSPARSE_RECIPE or nmcompile.region around the layers), or declare it with nmcompile.annotate(model, "
               "'sparsegpt:2:4') before finalize")
    return f"nmcompile.finalize(calibration=...): no weight of {name} is declared with a one-shot recipe (wanda, sparsegpt); {how}"
