"""Compute each separate DGRAD weight (Bi-Mask's ``W * B``) in the forward, next to its forward weight.

    w_nm = nmsparse::<op>(w, ...); w_dgrad = nmsparse::backward_mask_weight(w_nm, ...)
    return (*outputs,)  ->  return (*outputs, w_dgrad, ...)

A DGRAD weight is read only by the input-gradient GEMM, so AOTAutograd's partitioner would place
its computation in the backward graph, where ``w_nm`` must be read back from memory (on the CPU
benchmark it was out of every cache by then). Made an extra graph output, it is computed in the
forward right after ``w_nm`` and saved for the backward: one weight-sized tensor per layer more
kept between forward and backward. The backend drops these outputs before returning (see
``backends/nmsparse.py``), so the caller sees Dynamo's outputs unchanged.

Only for GEMMs whose input needs a gradient (not a model's first layer, and nothing in a graph
traced without grad), and only where the DGRAD weight feeds nmsparse's GEMM ops directly (inside
an activation checkpoint it is left to the partitioner, which saves memory there).
"""

from __future__ import annotations

import torch
from torch import fx

from .context import PassContext

_GEMMS = (torch.ops.nmsparse.linear.default, torch.ops.nmsparse.conv.default)


def _needs_input_grad(dgrad: fx.Node) -> bool:
    """Whether a GEMM reading ``dgrad`` (directly or through ``t``) computes an input gradient;
    False when anything else reads it."""
    needed = False
    for user in dgrad.users:
        operand = user if user.target is torch.t else dgrad
        for gemm in (user.users if user.target is torch.t else [user]):
            if gemm.target not in _GEMMS or gemm.args[2] is not operand:
                return False
            x = gemm.args[0]
            value = x.meta.get("example_value") if isinstance(x, fx.Node) else None
            needed = needed or bool(getattr(value, "requires_grad", False))
    return needed


def save_dgrad_weights(gm: fx.GraphModule, ctx: PassContext) -> int:
    saved = [
        dgrad for _, dgrad, _ in ctx.projected.values()
        if dgrad is not None and _needs_input_grad(dgrad)
    ]
    if not saved:
        return 0
    output = next(iter(gm.graph.find_nodes(op="output")))
    (outputs,) = output.args
    if not isinstance(outputs, (tuple, list)):  # Dynamo returns a tuple; anything else stays as it is
        return 0
    output.args = ((*outputs, *saved),)
    ctx.extra_outputs += len(saved)
    gm.graph.lint()
    gm.recompile()
    return len(saved)
