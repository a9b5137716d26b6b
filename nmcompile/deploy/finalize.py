"""From a sparse-trained model to a plain one: each layer's effective weight baked into its parameter.

:func:`finalize` writes the weight each annotated layer's forward uses (S-STE: ``beta * S(W)``,
MDGF at the end of its decay: the binary mask, ASP and transposable: the stored mask) into the
parameter, removes the recipe state buffers and the annotation, and records that it is a
deployed N:M weight (a :class:`Deployed` in the owning module's records, :mod:`nmcompile.state.records`).
The model then computes the same function with plain modules, its ``state_dict`` loads into the model without nmcompile, and the ``nmsparse``
backend can rewrite its GEMMs to sparse kernels.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .. import masks
from ..state import records
from ..declare.annotate import skip_reason, annotation_of, detach_recipe
from .inspection import effective_records
from ..oneshot.calibrate import solve_one_shot
from ..pattern import NMPattern
from ..state.deployed import Deployed, FinalizeReport
from ..state.records import DEPLOYED, deployed_of, owners, state_of
from ..state.sharding import full
from ..kernels.dispatch import DECISION_ATTR

__all__ = ["finalize", "FinalizeReport", "Deployed", "deployed_of", "deploy_report"]


def _loaded(model: nn.Module, pattern: NMPattern, report: FinalizeReport) -> list:
    """``(name, places, Deployed)`` of each plain weight that is already ``pattern`` along its
    reduction dimension; the others go to ``report.dense`` with the reason."""
    found = []
    for name, places in owners(model):
        _, module, pname = places[0]
        param = module._parameters[pname]
        if param.dim() < 2 or annotation_of(module, pname) is not None or deployed_of(module, pname) is not None:
            continue  # biases and norms never take a pattern
        reason, dim = skip_reason(places, pattern)
        if reason is None:
            bad, total = masks.count_violations(full(param.detach()), pattern.n, pattern.m, dim)
            if not bad:
                found.append((name, places, Deployed(pattern, dim, "")))
                continue
            reason = f"{bad}/{total} groups along dim {dim} keep more than {pattern.n} of {pattern.m}"
        report.dense[name] = reason
    return found


def _not_nm_hint(recipe) -> str:
    name = recipe.name
    if name == "mdgf":
        return "MDGF's alpha is still > 0: pruned weights still contribute; train until alpha reaches 0"
    if name == "step":
        return "STEP is still in its dense phase 1"
    if name == "sdgf":
        return "SDGF has not reached its last frame"
    return "the forward weight is not N:M"


def _grid(name: str, ann, place, solved: dict) -> tuple[torch.Tensor | None, int | None]:
    """``(scales, bits)`` of the grid a weight's kept values were put on (a one-shot solve's, or the grid a
    trained recipe with ``bits`` rounds its forward weight to), else ``(None, None)``."""
    if name in solved:
        return solved[name].scales, solved[name].bits
    _, module, pname = place
    grid = ann.recipe.grid(full(module._parameters[pname].detach()),
                           *(full(t) for t in state_of(module, pname, ann)), dim=ann.dim)
    return (grid, ann.recipe.bits) if grid is not None else (None, None)


def finalize(model: nn.Module, *, force: bool = False, pattern: NMPattern | str | None = None,
             calibration=None, sequential: bool | None = None, calibration_options: dict | None = None,
             progress=None, compute_dtype: torch.dtype | None = None) -> FinalizeReport:
    """Bake every annotated weight's effective weight into its parameter and drop training state.

    Idempotent: calling it on a finalized model changes nothing and returns the same report.

    Args:
        model: a model annotated with :func:`nmcompile.annotate` (or compiled with a recipe
            through backend options and run once).
        force: when a layer's forward weight is not N:M yet (MDGF with alpha > 0, STEP in phase 1,
            SDGF before its last frame), prune it to N:M anyway; that changes the function, and the
            relative change is warned about and recorded in the report. Without it, such a model
            is refused and left untouched.
        pattern: for a model that a finalized checkpoint was loaded into (``load_state_dict`` into
            a freshly built model, e.g. in a serving process), ``"2:4"``: every plain weight of a
            supported layer that is already N:M along its reduction dimension is recorded as
            deployed, unchanged; the others stay dense, listed with the reason in ``report.dense``.
        calibration: for one-shot recipes (``wanda``, ``sparsegpt``), the calibration batches (a list of
            input tensors, of keyword dicts such as ``{"input_ids": ids, "use_cache": False}``, or of
            argument tuples; finalize runs the model on them itself), or a function of no arguments
            that runs the compiled model over them (eval, no grad). Without it, finalize solves from
            the statistics gathered by the forwards run so far. A recipe declared through compile
            options, ``NMSPARSE_RECIPE`` or a region exists once a compiled forward has run: the
            calibration's first run declares it (with batches, finalize compiles the model itself, so
            compile options go in ``calibration_options``). On a model already finalized the
            calibration is not run (a warning) and the same report comes back.
        sequential: solve one block (the weights under one numbered module, ``layers.3``) at a time,
            in the order the model runs them, each calibrated on the outputs of the blocks already
            pruned (SparseGPT's sequential form; needs ``calibration``). With batches it costs about
            one forward pass: the first block's inputs are caught once and each block runs alone on
            them (:mod:`nmcompile.oneshot.sequential`); with a function, or blocks that do not form a
            chain, the model runs again before each block, in the order the model runs its blocks (learnt
            from one more call of the function, run eagerly and stopped after the model's first forward;
            the order is named in ``report.calibration`` where it is not registration order). ``None`` (the default): sequential when one
            pass's statistics, held twice, would take more than half the memory available, else one pass; the
            choice and why are in ``report.calibration``.
        calibration_options: ``nmsparse`` backend options of the graphs finalize compiles for
            calibration batches (default inner compiler: ``aot_eager`` for one pass, Inductor for each
            block of a sequential solve, which updates the statistics in place).
        progress: ``progress(done, total, note)``: each phase of a one-shot solve (the calibration batches of
            one pass, then the weights solved; or the blocks of a sequential solve) starts with a call with
            ``done == 0`` whose ``note`` names it, then one call per step.
        compute_dtype: the dtype calibration batches run in (each block of a sequential solve, else the
            whole model, raised while it runs and written back in its own dtype after). ``None``: float32
            for a bf16/fp16 model on a CPU without native arithmetic for it (AVX2), else the model's
            dtype (:mod:`nmcompile.oneshot.compute_dtype`); the choice is in ``report.calibration``.

    One-shot weights are solved first (:mod:`nmcompile.oneshot.solve`); what was done instead of the
    normal solve for a weight (no token reached it: magnitude; a singular Hessian) is warned about
    and listed in ``report.fallbacks``.

    Raises:
        ValueError: nothing in ``model`` is annotated or finalized, or a layer is not N:M and
            ``force`` is False.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"finalize takes an nn.Module, got {type(model).__name__}")
    report = FinalizeReport()
    solved = solve_one_shot(model, calibration, sequential, report, calibration_options, progress, compute_dtype)
    loaded = [] if pattern is None else _loaded(model, NMPattern.of(pattern), report)
    baked, problems, changed = [], [], []
    broken: dict[str, str] = {}
    dense_trained: list[str] = []
    for name, ann, weight in effective_records(model, broken):
        if name in broken:
            continue
        nm, dim = ann.recipe.pattern, ann.dim
        if name in solved:
            weight = solved[name].weight
        why = None if ann.recipe.calibrated else records.left_dense(ann)
        if why is not None and not force:
            dense_trained.append(f"{name} ({ann.recipe}): {why}")
            continue
        bad, total = masks.count_violations(weight, nm.n, nm.m, dim)
        change = 0.0
        if why is not None:
            pruned = masks.prune(weight, nm.n, nm.m, dim)
            change = float((pruned - weight).float().norm() / weight.float().norm().clamp_min(1e-30))
            changed.append(f"{name}: {change:.3g} (trained dense: the graph left it dense)")
            baked.append((name, ann, pruned, Deployed(nm, dim, "", change, why)))
            continue
        if bad:
            if not force:
                problems.append(f"{name} ({ann.recipe}): {bad}/{total} groups are not {nm}; {_not_nm_hint(ann.recipe)}")
                continue
            pruned = masks.prune(weight, nm.n, nm.m, dim)
            change = float((pruned - weight).float().norm() / weight.float().norm().clamp_min(1e-30))
            changed.append(f"{name}: {change:.3g}")
            weight = pruned
        baked.append((name, ann, weight, Deployed(nm, dim, str(ann.recipe), change)))
    if broken:
        raise ValueError(
            "nmcompile.finalize: the recipe state of these layers is none their recipe makes, nothing was "
            "changed:\n  " + "\n  ".join(f"{name}: {why}" for name, why in broken.items())
        )
    if dense_trained:
        raise ValueError(
            "nmcompile.finalize: the compiled graph left these declared weights dense (the compile warning named "
            "them), so they trained dense and their recipe's N:M weight is not what the model computes; nothing "
            "was changed:\n  " + "\n  ".join(dense_trained)
            + "\nUse each weight through F.linear, x @ W, addmm or a batched conv in the model and train again, or "
            "call finalize(model, force=True) to prune them by magnitude (changes the function; recorded as trained "
            "dense, not with the recipe)"
        )
    if problems:
        raise ValueError(
            "nmcompile.finalize: these layers are not N:M yet, nothing was changed:\n  "
            + "\n  ".join(problems)
            + "\nFinish training, or call finalize(model, force=True) to prune them (changes the function)."
        )
    for name, places in owners(model):
        record = deployed_of(*places[0][1:])
        if record is not None:
            report[name] = record
    if not baked and not report and not loaded:
        if pattern is not None:
            raise ValueError(
                f"nmcompile.finalize: no weight of {type(model).__name__} is {pattern} along its reduction "
                "dimension, so none was recorded as deployed (was the finalized checkpoint loaded?):\n  "
                + "\n  ".join(f"{name}: {why}" for name, why in report.dense.items())
            )
        raise ValueError(
            f"nmcompile.finalize: no weight of {type(model).__name__} is annotated or finalized; declare a "
            "recipe with nmcompile.annotate(model, 'sr_ste:2:4') and train before finalizing, or pass "
            "pattern='2:4' for a model a finalized checkpoint was loaded into"
        )
    for name, places, record in loaded:
        records.put(places[0][1], DEPLOYED, places[0][2], record)
        report[name] = record
    places_of = dict(owners(model))
    with torch.no_grad():
        for name, ann, weight, record in baked:
            grid, bits = _grid(name, ann, places_of[name][0], solved)
            key = records.INT4 if bits == 4 else records.INT8
            for _, module, pname in places_of[name]:
                param = module._parameters[pname]
                param.copy_(weight)
                detach_recipe(module, pname)
                records.put(module, DEPLOYED, pname, record)
                records.drop(module, records.INT8, pname)
                records.drop(module, records.INT4, pname)
                if grid is not None:  # the grid of a recipe with bits=8 or 4, for pack_weights and the codes files
                    records.put(module, key, pname, grid)
            report[name] = record
    if changed:
        warnings.warn(
            "nmcompile.finalize(force=True) pruned layers whose forward weight was not N:M; relative "
            "change of each weight: " + ", ".join(changed),
            stacklevel=2,
        )
    return report


def deploy_report(model: nn.Module) -> dict[str, object]:
    """``{parameter name: kernel decision}`` for every finalized weight of ``model``.

    A decision (:class:`nmcompile.kernels.dispatch.Decision`: ``kernel``, ``reason``, ``alg_id``,
    ``min_tokens``, ``speedup``; on a CPU also ``isa``, ``max_tokens`` and the measured ``ratios``,
    with ``token_range`` in words) exists once ``torch.compile(model, backend="nmsparse")`` has run
    or :func:`nmcompile.deploy.pack_weights` packed the weight;
    before that the entry is the string ``"not compiled yet"``.
    """
    out: dict[str, object] = {}
    for name, places in owners(model):
        _, module, pname = places[0]
        if deployed_of(module, pname) is not None:
            out[name] = getattr(module._parameters[pname], DECISION_ATTR, "not compiled yet")
    return out
