"""Solve the one-shot recipes (Wanda, SparseGPT) from the statistics their graphs gathered.

:func:`solve` computes each calibrated weight's pruned (and, for SparseGPT, updated) value in
float32 from its ``stat``/``count`` buffers, per expert for stacked weights, without changing the
model. :func:`solve_sequential` does it block by block (a block: the weights under one numbered
module, ``...layers.3.``), running the caller's calibration again before each block with the
blocks before it already pruned in place, so each block is solved on the inputs the pruned model
gives it (SparseGPT's sequential form). Both return ``{name: Solved}``; :func:`nmcompile.finalize`
bakes them.

What is not normal calibration is named, never left silent:

- no token reached any calibrated weight: :class:`NoCalibration` (a ``ValueError``);
- non-finite statistics (NaN/inf activations): ``ValueError`` naming the weight;
- one weight (or expert) no token reached (a graph break, an unused expert): pruned by magnitude,
  named in ``Solved.notes``;
- SparseGPT with fewer tokens than input columns: solved with its dampening, named;
- a Hessian that cannot be factored: pruned by Wanda's score from its diagonal, named.

In a process group every rank calls finalize: the statistics are summed over the ranks first, so
each rank may calibrate on its own share of the batches and all get the same weights.
"""

from __future__ import annotations

import itertools
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import masks
from ..masks.calibration import from_columns, to_columns, zero_undefined
from ..masks.oneshot import SingularHessian
from ..state import memory
from ..state.records import annotation_of, owners, state_of
from ..state.sharding import full

__all__ = ["Solved", "NoCalibration", "calibrated", "solve", "solve_sequential", "blocks", "reset", "release"]


class NoCalibration(ValueError):
    """No calibration token reached any weight of a one-shot recipe."""


@dataclass
class Solved:
    weight: torch.Tensor  # the new weight, in the parameter's dtype
    notes: list[str] = field(default_factory=list)  # named fallbacks
    scales: torch.Tensor | None = None  # bits=8: fp32 [*experts, out rows], the grid each row's kept entries are on;
    # bits=4: fp16 [*experts, out rows, in / group]
    bits: int | None = None


def calibrated(model: nn.Module) -> list[tuple[str, list, object]]:
    """``(name, holders, annotation)`` of every weight declared with a one-shot recipe."""
    found = []
    for name, places in owners(model):
        ann = annotation_of(*places[0][1:])
        if ann is not None and ann.recipe.calibrated:
            found.append((name, places, ann))
    return found


def _hint(recipe) -> str:
    return (f"run the model compiled with torch.compile(model, backend='nmsparse') over calibration batches "
            f"(model.eval(), torch.no_grad()) before nmcompile.finalize, or pass finalize(model, calibration=fn) "
            f"with fn running them; {recipe} gathers its statistics inside the compiled graph only")


def solve_one(name: str, module: nn.Module, pname: str, ann) -> Solved:
    recipe, dim = ann.recipe, ann.dim
    param = full(module._parameters[pname].detach())
    stat, count = (full(t) for t in state_of(module, pname, ann))
    if not bool(torch.isfinite(_live(stat, count)).all()):
        raise ValueError(
            f"nmcompile.finalize: {name} ({recipe}): its calibration statistics are not finite (NaN or inf "
            f"activations reached it); nothing was changed. Check the calibration data and the model in eval() on "
            f"it (an overflow in float16: calibrate in float32 or bfloat16), then reset the statistics "
            f"(nmcompile.oneshot.solve.reset(model)) and calibrate again"
        )
    columns = to_columns(param.float(), dim)
    out = torch.empty_like(columns)
    cols = columns.shape[-1]
    if recipe.bits == 4 and cols % recipe.group:
        raise ValueError(f"nmcompile.finalize: {name} ({recipe}): {cols} input columns are not a multiple of "
                         f"group={recipe.group}; nothing was changed. Keep this layer at bits=8 or float values "
                         "(exclude it from the bits=4 declaration)")
    scales = {8: lambda: torch.ones(columns.shape[:-1]),
              4: lambda: torch.ones(*columns.shape[:-1], cols // recipe.group, dtype=torch.float16)}.get(recipe.bits)
    scales = scales() if scales else None
    notes: list[str] = []
    for index in itertools.product(*(range(size) for size in columns.shape[:-2])):
        where = name + (f"[expert {index[0] if len(index) == 1 else index}]" if index else "")
        w, tokens = columns[index], int(count[index])
        if tokens == 0:
            out[index] = masks.prune(w, recipe.n, recipe.m, -1)
            notes.append(f"{where}: no calibration token reached it (a graph break, an unused expert, or a layer "
                         "outside the compiled model); pruned by magnitude")
            if scales is not None:
                out[index], scales[index] = recipe.to_grid(out[index])
            continue
        if recipe.gram and tokens < cols:
            notes.append(f"{where}: {tokens} calibration tokens for {cols} input columns, so X^T X has rank <= "
                         f"{tokens}; solved with its dampening ({recipe.percdamp}); calibrate on at least {cols} tokens")
        try:
            out[index], row_scales = recipe.solve_quantized(w, stat[index], tokens)
            if scales is not None:
                scales[index] = row_scales
        except SingularHessian as err:
            out[index] = masks.oneshot.wanda(w, torch.diagonal(stat[index]), recipe.n, recipe.m)
            notes.append(f"{where}: {err}; pruned by Wanda's score |W| * ||X|| instead, without updates "
                         f"(raise percdamp, e.g. {recipe.name}:{recipe.n}:{recipe.m},percdamp=0.1)")
            if scales is not None:
                out[index], scales[index] = recipe.to_grid(out[index])
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"nmcompile.finalize: {name} ({recipe}): the solve gave non-finite weights; nothing was "
                         "changed. Raise percdamp or calibrate on more tokens")
    return Solved(from_columns(out, param.shape, dim).to(param.dtype).contiguous(), notes, scales, recipe.bits)


def _live(stat: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The statistics that hold rows (``count > 0``); the rest are undefined."""
    if count.dim() == 0:
        return stat if int(count) > 0 else stat.new_empty(0)
    return stat[count > 0]


def release(*stats: torch.Tensor) -> None:
    """Give the memory of ``stats`` back and leave them undefined (their counts must be 0): the same
    tensors, shapes and strides (compiled graphs keep reading them), on new untouched memory (no
    resident pages until written). A DTensor or another subclass keeps its memory."""
    storages = [(t.untyped_storage(), t.untyped_storage().nbytes()) for t in stats
                if type(t) is torch.Tensor and t.device.type != "meta"]
    for storage, _ in storages:
        storage.resize_(0)
    if any(storage.device.type == "cpu" for storage, _ in storages):
        memory.trim_heap()
    for storage, nbytes in storages:
        storage.resize_(nbytes)


def _sum_over_ranks(model: nn.Module, names=None) -> None:
    """Sum the statistics over the process group: each rank calibrated on its own batches.

    Every rank must call finalize (a collective). DDP's ``broadcast_buffers`` would overwrite the
    other ranks' statistics at each forward: calibrate the compiled module itself on each rank.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if torch.distributed.get_world_size() == 1:
        return
    for name, places, ann in calibrated(model):
        if names is None or name in names:
            stat, count = state_of(places[0][1], places[0][2], ann)
            with torch.no_grad():  # a rank that saw no rows holds undefined statistics: it adds zeros
                zero_undefined(stat, count)
            torch.distributed.all_reduce(stat)
            torch.distributed.all_reduce(count)


def solve(model: nn.Module, progress=None) -> dict[str, Solved]:
    """Every calibrated weight solved from its statistics (the model is not changed)."""
    _sum_over_ranks(model)
    items = calibrated(model)
    if items and all(int(state_of(*p[0][1:], ann)[1].sum()) == 0 for _, p, ann in items):
        raise NoCalibration(
            f"nmcompile.finalize: no calibration batch reached the {len(items)} weights declared with "
            f"{items[0][2].recipe} (their token counts are 0); {_hint(items[0][2].recipe)}"
        )
    if progress is not None:
        progress(0, len(items), "solving weights")
    solved = {}
    for k, (name, places, ann) in enumerate(items):
        solved[name] = solve_one(name, places[0][1], places[0][2], ann)
        if progress is not None:
            progress(k + 1, len(items), name)
    return solved


def blocks(names: list[str]) -> list[list[str]]:
    """``names`` grouped by the numbered module they sit under (``model.layers.3``), in order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        found = re.match(r"(.*?\.\d+)\.", name)
        groups.setdefault(found.group(1) if found else name, []).append(name)
    return list(groups.values())


def reset(model: nn.Module, names=None) -> None:
    """Forget the calibration statistics of the one-shot weights (``names``: only those): their counts
    become 0 and their statistics' memory is given back (:func:`release`)."""
    stats = []
    with torch.no_grad():
        for name, places, ann in calibrated(model):
            if names is None or name in names:
                stat, count = state_of(places[0][1], places[0][2], ann)
                count.zero_()
                stats.append(stat)
        release(*stats)


def solve_sequential(model: nn.Module, calibration, groups: list[list[str]] | None = None) -> dict[str, Solved]:
    """Solve block by block, calibrating each block on the outputs of the blocks already pruned.

    ``groups``: the blocks (:func:`blocks`) in the order to solve them, which should be the order the
    model runs them (:func:`nmcompile.oneshot.block_order.run_order`); default: registration order.

    ``calibration()`` runs the compiled model over the calibration batches; it is called once per
    block, with every other weight's count set to -1, which pauses its statistics (the op neither
    adds to them nor touches them), so each pass computes the statistics of one block only. Solved
    weights are written into the model as each block is done, and the block's statistics are released
    (:func:`release`): where the compiled graph updates them in place (Inductor, the default inner
    compiler), only one block's statistics are resident at a time, so memory does not grow with depth.
    (``inner="aot_eager"`` copies every mutated buffer at every call, which writes them all.)
    """
    items = {name: (places, ann) for name, places, ann in calibrated(model)}
    counts = {name: state_of(places[0][1], places[0][2], ann)[1] for name, (places, ann) in items.items()}
    solved: dict[str, Solved] = {}
    groups = blocks(list(items)) if groups is None else groups
    written: list[str] = []
    reset(model)  # earlier statistics would not be used: give their memory back first
    try:
        for block in groups:
            reset(model, block)
            with torch.no_grad():
                for name in items:
                    if name not in block:
                        counts[name].fill_(-1)  # paused: only this block gathers in this pass
            calibration()
            _sum_over_ranks(model, block)
            if all(int(counts[name].sum()) == 0 for name in block) and not solved:
                recipe = items[block[0]][1].recipe
                raise NoCalibration(f"nmcompile.finalize: calibration() ran, but no token reached the weights "
                                    f"declared with {recipe}; {_hint(recipe)}")
            with torch.no_grad():
                for name in block:
                    places, ann = items[name]
                    result = solve_one(name, places[0][1], places[0][2], ann)
                    for _, module, pname in places:
                        module._parameters[pname].copy_(result.weight)
                    # the parameter now holds it: no second copy of each solved weight grows with depth
                    solved[name] = Solved(full(places[0][1]._parameters[places[0][2]].detach()), result.notes,
                                          result.scales, result.bits)
            reset(model, block)  # solved: its statistics' memory goes back before the next block's pass
            found = re.match(r"(.*?\.\d+)\.", block[0])
            written.append(found.group(1) if found else block[0])
    except BaseException as err:
        half_written(err, written, len(groups))
        raise
    finally:
        with torch.no_grad():  # no count stays paused (negative), whatever happened
            for count in counts.values():
                count.clamp_(min=0)
    return solved


def half_written(err: BaseException, written: list[str], total: int) -> None:
    """When some blocks were already written: raise ``err`` again as a ValueError that names them, or
    (any other error, an interrupt included) add that as a note to ``err``, which the caller re-raises."""
    if not written:
        return
    what = (f"{len(written)} of {total} blocks were already pruned and written in place ({written[0]} .. "
            f"{written[-1]}); the rest are unchanged and still declared; reload the dense model before trying "
            "again")
    if not isinstance(err, ValueError):
        note = f"nmcompile.finalize (sequential): {what}"
        if hasattr(err, "add_note"):  # Python 3.11+
            err.add_note(note)
        else:
            warnings.warn(note, stacklevel=3)
    else:
        message = str(err)
        raise ValueError(message.replace("nothing was changed", what) if "nothing was changed" in message
                         else f"{message}\nnmcompile.finalize (sequential): {what}") from err
