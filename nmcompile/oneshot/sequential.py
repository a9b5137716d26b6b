"""Sequential one-shot calibration on cached block inputs: about one forward pass in all.

SparseGPT's sequential form solves the blocks (``model.layers.3``) in the order the model runs them,
each calibrated on the outputs of the blocks before it, already pruned. Re-running the whole model
before each block costs a forward per block (the work grows with depth squared); here the inputs of
the first block are caught once per batch, then each block runs alone on them:

1. one sample of the first batch runs through the eager model with every block hooked: the order
   the blocks run in, and whether they form a chain (each block's input is the output of the one
   before it, and every block gets the same other arguments: attention masks, rotary embeddings).
   Where they do not, :class:`Unchained` says why and the caller falls back to re-running the model;
2. each batch runs until the first block is called, which records its arguments and stops it;
3. per block: the block compiled with the ``nmsparse`` backend gathers its weights' statistics over
   the cached inputs; its weights are solved and written; the block runs again with its statistics
   paused and its outputs become the next block's inputs (spilled to disk when they are large).

An error in a block names the blocks already written, so that a half-pruned model is never taken for
an untouched one.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Mapping

import torch
from torch import nn

from ..state.records import state_of
from ..state import memory
from . import solve as oneshot
from .compute_dtype import raised, stored_dtype, to_dtype

__all__ = ["Unchained", "chain", "solve_cached", "run_batch", "SPILL_FRACTION"]

#: cached activations above this share of the memory available go to a temporary folder
SPILL_FRACTION = 0.25


class Unchained(Exception):
    """The model's blocks cannot run alone on cached inputs (the reason is the message)."""


class _Caught(Exception):
    """Raised by the first block's hook once its arguments are recorded."""


def run_batch(model, batch):
    """``model`` on one calibration batch: a tensor (``model(batch)``), a mapping of keyword
    arguments (``model(**batch)``) or a tuple of positional ones."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _first_sample(batch):
    if isinstance(batch, torch.Tensor):
        return batch[:1] if batch.dim() else batch
    if isinstance(batch, Mapping):
        return {k: _first_sample(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_first_sample(v) for v in batch)
    return batch


def _split(args: tuple, kwargs: dict):
    """``(hidden, other args, other kwargs)`` of a block call."""
    if args:
        return args[0], args[1:], kwargs
    if "hidden_states" in kwargs:
        rest = dict(kwargs)
        return rest.pop("hidden_states"), (), rest
    raise Unchained("a block was called without a positional input or hidden_states")


def _hidden_out(output):
    out = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(out, torch.Tensor):
        raise Unchained(f"a block returned {type(output).__name__}, not a tensor or a tuple starting with one")
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or a == b


def chain(model: nn.Module, prefixes: list[str], sample) -> list[str]:
    """``prefixes`` (the blocks' module names) in the order the model runs them, checked on ``sample``
    (one calibration batch, of which one row is used) to form a chain; :class:`Unchained` otherwise."""
    calls: list[tuple[str, object, tuple, dict]] = []
    outputs: dict[str, torch.Tensor] = {}
    handles = []

    def pre(name):
        def hook(module, args, kwargs):
            hidden, rest, rest_kw = _split(args, kwargs)
            calls.append((name, hidden.detach().clone() if isinstance(hidden, torch.Tensor) else hidden, rest, rest_kw))
        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            outputs[name] = _hidden_out(output).detach().clone()
        return hook

    try:
        for name in prefixes:
            module = model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(post(name), with_kwargs=True))
        with torch.no_grad():
            run_batch(model, _first_sample(sample))
    except AttributeError as err:
        raise Unchained(f"{err}") from err
    finally:
        for handle in handles:
            handle.remove()
    order = [name for name, *_ in calls]
    if len(set(order)) != len(order):
        twice = next(name for name in order if order.count(name) > 1)
        raise Unchained(f"{twice} ran more than once in one forward")
    missing = [name for name in prefixes if name not in order]
    if missing:
        raise Unchained(f"{', '.join(missing)} did not run in a forward of the first calibration batch")
    first = calls[0]
    for (before, *_), (name, hidden, rest, rest_kw) in zip(calls, calls[1:]):
        if not (isinstance(hidden, torch.Tensor) and _same(hidden, outputs[before])):
            raise Unchained(f"the input of {name} is not the output of {before}, which runs before it")
        if not (_same(rest, first[2]) and _same(rest_kw, first[3])):
            raise Unchained(f"{name} gets other arguments than {first[0]} (per-layer masks or caches)")
    return order


class _Activations:
    """The current block inputs, one tensor per batch: in memory, or in a temporary folder
    (memory-mapped when read) once they exceed :data:`SPILL_FRACTION` of the memory available."""

    def __init__(self, limit: int):
        self.items: list = []
        self.limit, self.bytes = limit, 0
        self.folder: tempfile.TemporaryDirectory | None = None

    def append(self, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        self.bytes += t.nbytes
        if self.folder is None and self.bytes > self.limit:
            self.folder = tempfile.TemporaryDirectory(prefix="nmcompile-activations-")
            self.items = [self._spill(x) for x in self.items]
        self.items.append(self._spill(t) if self.folder is not None else t)

    def _spill(self, t):
        if isinstance(t, str):
            return t
        path = os.path.join(self.folder.name, f"{len(os.listdir(self.folder.name))}.pt")
        torch.save(t, path)
        return path

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        item = self.items[i]
        return torch.load(item, mmap=True, weights_only=True) if isinstance(item, str) else item

    def close(self) -> None:
        if self.folder is not None:
            self.folder.cleanup()


def _capture(model: nn.Module, first: str, batches, limit: int, dtype: torch.dtype):
    """``(inputs, rests)``: the first block's input and other arguments for each batch, their
    floating-point tensors in the blocks' compute ``dtype``."""
    inputs, rests = _Activations(limit), []
    module = model.get_submodule(first)

    def hook(module, args, kwargs):
        hidden, rest, rest_kw = to_dtype(_split(args, kwargs), dtype)
        inputs.append(hidden)
        rests.append((rest, rest_kw))
        raise _Caught

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                try:
                    run_batch(model, batch)
                except _Caught:
                    continue
                raise Unchained(f"calibration batch {i} did not reach {first}")
    finally:
        handle.remove()
    return inputs, rests


def solve_cached(model: nn.Module, batches, *, options: dict | None = None, progress=None,
                 compute: torch.dtype | None = None) -> dict:
    """Solve every one-shot weight block by block on cached inputs (see the module doc).

    ``batches``: the calibration batches (a list). ``options``: the ``nmsparse`` backend options of
    each block's graph (default: Inductor, which updates the statistics in place). ``compute``: the
    dtype each block runs in while it is calibrated (:mod:`.compute_dtype`; default: the model's), its
    weights written back in their own dtype after. ``progress``:
    ``progress(done, total, note)`` once the inputs are caught and after each block. Returns ``{name: Solved}``; raises
    :class:`Unchained` (nothing changed) where the blocks do not form a chain."""
    items = {name: (places, ann) for name, places, ann in oneshot.calibrated(model)}
    groups = oneshot.blocks(list(items))
    prefixes = [_prefix(group[0]) for group in groups]
    if any(p is None for p in prefixes):
        loose = [g[0] for g, p in zip(groups, prefixes) if p is None]
        raise Unchained(f"{', '.join(loose)} is not inside a numbered block (such as layers.3)")
    of_prefix = dict(zip(prefixes, groups))
    order = chain(model, prefixes, batches[0])
    compute = compute or stored_dtype(model)
    inputs, rests = _capture(model, order[0], batches, int(SPILL_FRACTION * memory.available_bytes()), compute)
    options = {"inner": "inductor", **(options or {})}
    solved: dict = {}
    written: list[str] = []
    start = time.perf_counter()
    oneshot.reset(model)  # statistics gathered before would not be used
    if progress is not None:
        progress(0, len(order), "inputs caught")
    try:
        for k, prefix in enumerate(order):
            block, names = model.get_submodule(prefix), of_prefix[prefix]
            counts = [state_of(items[n][0][0][1], items[n][0][0][2], items[n][1])[1] for n in names]
            notes: dict[str, list[str]] = {}
            grids: dict[str, tuple] = {}
            with raised(block, compute):
                compiled = torch.compile(block, backend="nmsparse", options=options)
                with torch.no_grad():
                    for i in range(len(inputs)):
                        compiled(inputs[i], *rests[i][0], **rests[i][1])
                oneshot._sum_over_ranks(model, names)
                if all(int(c.sum()) == 0 for c in counts):
                    raise oneshot.NoCalibration(f"nmcompile.finalize: no calibration token reached the weights of "
                                                f"{prefix} when it ran on its cached inputs")
                with torch.no_grad():
                    for name in names:
                        places, ann = items[name]
                        result = oneshot.solve_one(name, places[0][1], places[0][2], ann)
                        for _, module, pname in places:
                            module._parameters[pname].copy_(result.weight)
                        notes[name] = result.notes
                        grids[name] = (result.scales, result.bits)
                written.append(prefix)
                oneshot.reset(model, names)
                if k + 1 < len(order):
                    outputs = _Activations(inputs.limit)
                    with torch.no_grad():
                        for c in counts:
                            c.fill_(-1)  # paused: the pruned block's outputs only
                        for i in range(len(inputs)):
                            outputs.append(_hidden_out(compiled(inputs[i], *rests[i][0], **rests[i][1])))
                        for c in counts:
                            c.zero_()
                    inputs.close()
                    inputs = outputs
            for name in names:  # the parameter back in its own dtype holds the solved weight
                places = items[name][0]
                solved[name] = oneshot.Solved(places[0][1]._parameters[places[0][2]].detach(), notes[name], *grids[name])
            del compiled
            memory.trim_heap()  # the block's temporaries (its solve, its raised copy) leave no resident pages
            if progress is not None:
                progress(k + 1, len(order), f"{prefix} in {time.perf_counter() - start:.0f}s")
    except BaseException as err:
        with torch.no_grad():  # no count stays paused (negative), whatever happened
            for name, (places, ann) in items.items():
                state_of(places[0][1], places[0][2], ann)[1].clamp_(min=0)
        oneshot.half_written(err, written, len(order))
        raise
    finally:
        inputs.close()
    return solved


def _prefix(name: str) -> str | None:
    """The numbered module ``name`` sits under (``model.layers.3``), or None."""
    found = re.match(r"(.*?\.\d+)\.", name)
    return found.group(1) if found else None
