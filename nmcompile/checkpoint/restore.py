"""Give a model loaded from a deployed directory its deploy records back, after checking its weights.

``from_pretrained`` (or any ``load_state_dict``) of a pruned model's directory gives a dense-looking model:
the weights are N:M, but nothing records it, so ``nmcompile.check`` checks nothing and the ``nmsparse``
backend has nothing to rewrite. :func:`restore` reads the directory's layout record
(:mod:`nmcompile.checkpoint.layout`), checks that each recorded weight of the model really is N:M along its
recorded dim, and records it as deployed, as :func:`nmcompile.finalize` did before saving.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .. import masks
from ..kernels.cpu24.weight import PackedLinearWeight
from ..state import records
from ..state.records import DEPLOYED, annotation_of, owners
from ..state.sharding import full
from .layout import Layout, read_layout, RECORD_FILE
from ..state.deployed import Deployed, FinalizeReport

__all__ = ["restore"]


def layout_from(source) -> tuple[Layout, str]:
    if isinstance(source, Layout):
        return source, "the layout"
    layout = read_layout(source)
    if layout is None:
        raise ValueError(
            f"{os.fspath(source)} has no nmcompile layout record ({RECORD_FILE}, or the 'nmcompile' entry of its "
            "safetensors metadata): it was not written by nmcompile.deploy.save_pretrained or nmcompile prune. For a "
            "model whose weights are N:M without a record, call nmcompile.finalize(model, pattern='2:4'), which "
            "records the weights that are 2:4 along their reduction dim"
        )
    return layout, os.fspath(source)


def _check_weight(name: str, param: torch.Tensor, entry) -> str | None:
    """What is wrong with ``param`` as the recorded N:M weight, or None."""
    if param.is_meta:
        return f"{name} is on the meta device: load the weights first (model.to_empty(...) and a load_state_dict)"
    if tuple(param.shape) != tuple(entry.shape):
        return f"{name} has shape {list(param.shape)}, the record says {list(entry.shape)}"
    weight = param.dense() if isinstance(param, PackedLinearWeight) else full(param.detach())
    why = entry.pattern.fits(weight, entry.dim)
    if why is not None:
        return f"{name} cannot be {entry.pattern} along dim {entry.dim}: {why}"
    bad, total = masks.count_violations(weight, entry.pattern.n, entry.pattern.m, entry.dim)
    if bad:
        return f"{name}: {bad}/{total} groups along dim {entry.dim} keep more than {entry.pattern.n} of {entry.pattern.m}"
    return None


def restore(model: nn.Module, source):
    """Record ``model``'s N:M weights as deployed from the layout record of ``source``; the report.

    Call it after a plain load of a directory written by :func:`nmcompile.deploy.save_pretrained` or
    ``nmcompile prune``::

        model = AutoModelForCausalLM.from_pretrained(path)
        nmcompile.deploy.restore(model, path)   # then nmcompile.check(model) passes, and
                                                # torch.compile(model, backend="nmsparse") deploys it

    Args:
        model: the loaded model (its weights real, dense or packed-only).
        source: the model directory, its weights file, or a :class:`~nmcompile.checkpoint.layout.Layout`.

    Returns:
        A :class:`~nmcompile.deploy.finalize.FinalizeReport`: ``{name: Deployed}`` of each recorded
        weight, ``dense`` with the record's dense weights and why.

    Raises:
        ValueError: ``source`` has no record, or a recorded weight is not in ``model``, has another shape,
            is declared with a training recipe, or is not N:M along its recorded dim (loaded from another
            checkpoint?). Each is named; nothing is recorded then.
    """
    layout, where = layout_from(source)
    places_of = {}
    for name, places in owners(model):
        for mname, _, pname in places:
            places_of[f"{mname}.{pname}" if mname else pname] = places
    problems, found = [], []
    for name, entry in layout.weights.items():
        places = places_of.get(name) or places_of.get(layout.canonical(name))
        if places is None:
            problems.append(f"{name} is not a parameter of {type(records.root(model)).__name__}")
            continue
        _, module, pname = places[0]
        if annotation_of(module, pname) is not None:
            problems.append(f"{name} is declared {annotation_of(module, pname).recipe} for training; restore records "
                            "the weights of a plain loaded model")
            continue
        problem = _check_weight(name, module._parameters[pname], entry)
        if problem is not None:
            problems.append(problem)
            continue
        found.append((name, places, Deployed(entry.pattern, entry.dim, entry.recipe)))
    if problems:
        raise ValueError(
            f"nmcompile.deploy.restore: the weights of {type(records.root(model)).__name__} are not the N:M weights "
            f"{where} records, nothing was recorded:\n  " + "\n  ".join(problems[:20])
            + (f"\n  ... {len(problems) - 20} more" if len(problems) > 20 else "")
            + "\nLoad that directory's own weights into the model, or call nmcompile.finalize(model, pattern='2:4') "
            "to record the weights that are N:M now"
        )
    report = FinalizeReport()
    for name, places, record in found:
        for _, module, pname in places:
            records.put(module, DEPLOYED, pname, record)
        report[name] = record
    report.dense.update(layout.dense)
    return report
