"""The order a model runs its one-shot blocks in, for the sequential solve that re-runs the model.

SparseGPT's sequential form calibrates each block on the outputs of the blocks that run before it,
already pruned: taken in registration order, a model that runs ``layers.2`` first would calibrate
it on the dense model's activations (one-pass quality) without a word. :func:`run_order` runs the
caller's calibration once with every compiled graph run eagerly (``torch.compiler.set_stance
("force_eager")``, scoped), records the first call of each block's module and stops at the end of
the model's first forward; no statistic is gathered in that pass.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..state.records import root

__all__ = ["run_order", "block_module"]


class _FirstForward(Exception):
    """Raised by the model's forward hook once its first forward has run."""


def block_module(model: nn.Module, group: list[str]) -> tuple[str, nn.Module]:
    """``(name, module)`` a group of :func:`nmcompile.oneshot.solve.blocks` runs as: its numbered
    module (``layers.3``), or the module that owns a weight outside every numbered module."""
    found = re.match(r"(.*?\.\d+)\.", group[0])
    name = found.group(1) if found else group[0].rpartition(".")[0]
    return name, (model.get_submodule(name) if name else model)


def run_order(model: nn.Module, groups: list[list[str]], calibration) -> tuple[list[list[str]], list[str]]:
    """``(groups in the order the model's first forward under calibration() runs them, the names of
    the blocks that forward did not run)``; the blocks it did not run follow in registration order."""
    model = root(model)
    first: dict[int, int] = {}
    handles = []

    def pre(index):
        def hook(module, args):
            first.setdefault(index, len(first))
        return hook

    def done(module, args, output):
        raise _FirstForward

    try:
        for index, group in enumerate(groups):
            handles.append(block_module(model, group)[1].register_forward_pre_hook(pre(index)))
        handles.append(model.register_forward_hook(done))
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            calibration()
    except _FirstForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    ran = sorted(first, key=first.__getitem__)
    missing = [index for index in range(len(groups)) if index not in first]
    return [groups[i] for i in ran + missing], [block_module(model, groups[i])[0] or groups[i][0] for i in missing]
