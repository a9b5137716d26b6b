"""What the annotated model computes now: effective weights and N:M compliance reports."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..masks.compliance import CheckReport, WeightCheck, check_one, selects
from ..pattern import NMPattern
from ..state import records
from ..state.records import WeightAnnotation, annotation_of, deployed_of, owners, state_of
from ..state.sharding import full
from ..checkpoint.file_checks import check_path
from ..checkpoint.file_checks import check_state

__all__ = ["effective_weights", "check", "CheckReport", "WeightCheck"]


def effective_records(model: nn.Module, problems: dict | None = None) -> Iterator[tuple[str, WeightAnnotation, torch.Tensor]]:
    """``(name, annotation, effective weight)`` of every annotated weight; ``problems`` (when given)
    gets ``{name: what is wrong with its recipe state}`` for each weight whose state is none its
    recipe makes."""
    for mname, module in records.root(model).named_modules():
        for pname, ann in records.table(module, records.RECIPES).items():
            if pname not in module._parameters:
                name = f"{mname}.{pname}" if mname else pname
                if "parametrizations" in module._modules:
                    raise ValueError(records.parametrized_reason(name, ann.recipe))
                raise ValueError(
                    f"{name} is declared {ann.recipe}, but it is no longer a parameter of {type(module).__name__}; "
                    f"drop the declaration (nmcompile.declare.annotate.detach_recipe(module, {pname!r})) or make it "
                    "a parameter again"
                )
    with torch.no_grad():
        for name, places in owners(model):
            _, module, pname = places[0]
            ann = annotation_of(module, pname)
            if ann is not None:
                records.refresh_if_replaced(module, pname, ann, name)
                param = module._parameters[pname]
                state = state_of(module, pname, ann)
                if param.is_meta or ann.pending:
                    raise ValueError(
                        f"{name} ({ann.recipe}) is on the meta device: its state is computed from real "
                        "weights; call model.to_empty(device=...) and initialise the weights first"
                    )
                if problems is not None:
                    problem = ann.recipe.state_problem(full(param.detach()), *(full(t) for t in state), dim=ann.dim)
                    problem = problem or ann.averaged  # what the step driver found in a copy (an EMA)
                    if problem is not None:
                        problems[name] = _state_message(problem, ann.buffer_names(pname), ann.recipe.calibrated)
                if records.left_dense(ann) is not None:  # the graph's forward uses the dense weight
                    yield name, ann, full(param.detach())
                    continue
                yield name, ann, ann.recipe.project(full(param.detach()), *state, dim=ann.dim)


def effective_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: the weight its layer's forward uses now}`` for every annotated weight.

    A pure function of the weights and the recipe state (e.g. ``beta * S(W)`` for S-STE). Weights
    annotated through backend options, ``NMSPARSE_RECIPE`` or a region appear once the compiled
    model has run. A declared weight that the compiled graph left dense (used through ``einsum``,
    ``x @ W.t()``, along two reduction dims: the compile warning names it) is its dense parameter,
    which is what that graph's forward uses; :func:`check` names it.
    """
    return {name: weight for name, _, weight in effective_records(model)}


def _state_message(problem: str, buffers: tuple[str, ...], calibrated: bool = False) -> str:
    """A recipe state problem, with its usual cause and the fix."""
    if calibrated:  # one-shot statistics: a count below 0 pauses them
        return (
            f"{problem}: its calibration statistics ({', '.join(buffers)}) are paused (a sequential finalize pauses "
            "the blocks it is not calibrating with a count of -1), so calibration adds nothing to them. Reset them "
            "with nmcompile.oneshot.solve.reset(model) and calibrate again"
        )
    return (
        f"{problem}: its recipe state ({', '.join(buffers)}) was not written by "
        "nmcompile. Masks and step clocks must be copied, never averaged: "
        "torch.optim.swa_utils.AveragedModel(..., use_buffers=True) averages every buffer, so build the "
        "average with use_buffers=False (buffers are then copied from the model at each update), or load "
        "the state from the trained model"
    )


_UNSOLVED = ("{recipe} is not solved yet (the weight stays dense while calibrating): run calibration batches "
             "through the model compiled with backend='nmsparse', then nmcompile.finalize(model)")


def _left_dense(ann: WeightAnnotation) -> str:
    why = records.left_dense(ann)
    if why is None:
        return ""
    return (f"declared {ann.recipe}, but the nmsparse graph left it dense, so it trains dense and its forward uses "
            f"the dense weight: {why}")


def check(obj, pattern: NMPattern | str | None = None, *, dim: int | None = None, only=None) -> CheckReport:
    """N:M compliance per weight of a model (its effective weights) or a state dict.

    Args:
        obj: an annotated or finalized ``nn.Module``, a ``{name: tensor}`` state dict (packed 2:4
            entries are unpacked) or a checkpoint dict that holds one (``{"model": sd, "epoch": 3}``,
            see :func:`nmcompile.checkpoint.file_checks.find_state_dict`), or the path of a model directory
            written by :func:`nmcompile.deploy.save_pretrained` or ``nmcompile prune``, a ``.safetensors``
            file, an ``.onnx`` file or a ``torch.save``'d state dict or checkpoint. A directory, or a file
            in it, is checked with its layout record (``nmcompile.json``: each weight along its recorded
            dim, with its recorded pattern; the weights it keeps dense are listed as not checked), see
            :mod:`nmcompile.checkpoint.file_checks`.
        pattern: ``NMPattern`` or ``"2:4"``. Default: each weight's recipe pattern for a model, the
            recorded one for a file with a layout record, 2:4 for other state dicts.
        dim: grouping dimension for state-dict tensors (1 for Linear/Conv, 0 for GPT-2 Conv1D).
            Default: the recorded dim of each weight where there is a record, the dim a packed entry was
            packed along, else 1. A failed check without a record gets ``report.hint``: a ``dim`` and
            ``only`` that fit the file.
        only: glob pattern(s) of the names to check (``fnmatch``, e.g. ``"blocks.*.weight"``); the
            others are counted, not checked. A state dict holds every weight of the model, also those
            never declared N:M (embeddings, a head left out with ``exclude``), which are dense:
            ``only`` checks the declared ones. Default: every tensor.

    The report's ``ok`` is False when no tensor was checked. Raises ValueError for a file that
    cannot be read as a state dict or an ONNX model, a damaged packed state dict (see
    :func:`nmcompile.deploy.unpack_state_dict`), a checkpoint whose state dict cannot be told
    apart, and a ``dim`` that a checked tensor does not have.
    """
    pattern = None if pattern is None else NMPattern.of(pattern)
    report = CheckReport()
    if isinstance(obj, nn.Module):
        problems: dict[str, str] = {}
        for name, ann, weight in effective_records(obj, problems):
            if selects(report, name, only):
                problem = (_left_dense(ann) or problems.get(name)
                           or (_UNSOLVED.format(recipe=ann.recipe) if ann.recipe.calibrated else ""))
                check_one(report, name, weight, pattern or ann.recipe.pattern, ann.dim, problem)
        for name, places in owners(obj):
            _, module, pname = places[0]
            record = deployed_of(module, pname)
            if record is not None and selects(report, name, only):
                weight = full(module._parameters[pname].detach())
                check_one(report, name, weight, pattern or record.pattern, record.dim)
        return report
    if isinstance(obj, (str, os.PathLike)):
        if os.fspath(obj).endswith(".onnx"):
            from .onnx import check_onnx

            return check_onnx(obj, pattern, dim=1 if dim is None else dim, only=only)

        return check_path(obj, pattern, dim, only)
    if isinstance(obj, Mapping):
        return check_state(obj, pattern, dim, only)
    raise TypeError(f"check takes an nn.Module or a state dict, got {type(obj).__name__}")
