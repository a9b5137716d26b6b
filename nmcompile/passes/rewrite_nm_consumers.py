"""Route GEMMs whose backward a recipe changes through nmcompile's GEMM ops.

    linear(x, w_nm, b)   ->  nmsparse::linear(x, w_nm, w_dgrad, b, mvue_n, mvue_m, fp8)
    addmm(b, x, w_nm)    ->  nmsparse::linear(x, w_nm.t(), w_dgrad.t(), b, ...)   (weight [in, out])
    conv2d(x, w_nm, ...) ->  nmsparse::conv(x, w_nm, w_dgrad, b, stride, padding, dilation, groups, ...)

Only for targets whose recipe sets ``wgrad="mvue12"/"mvue24"``, ``fp8`` or a separate DGRAD weight
(Bi-Mask); every other GEMM keeps aten's backward. Runs after :mod:`.insert_nm_projections`, which
records each target's projected and DGRAD weight nodes and the model's uses in ``ctx.projected``.
"""

from __future__ import annotations

import torch
from torch import fx

from . import _graph
from .context import PassContext


def _transposed(graph: fx.Graph, node: fx.Node, cache: dict) -> fx.Node:
    if node not in cache:
        with graph.inserting_after(node):
            cache[node] = graph.call_function(torch.t, (node,))
        cache[node].meta["example_value"] = node.meta["example_value"].t()
    return cache[node]


def rewrite_nm_consumers(gm: fx.GraphModule, ctx: PassContext) -> int:
    graph = gm.graph
    count = 0
    for target in ctx.targets:
        recipe = target.recipe
        if not recipe.rewrites_consumer:
            continue
        weight, dgrad, uses = ctx.projected[target.fqn]
        dgrad = dgrad if dgrad is not None else weight
        mvue_n, mvue_m = recipe.mvue or (0, 0)
        cache: dict = {}
        for user in uses:
            ops = _graph.gemm_operands(user, weight)
            if ops is None:  # find_nm_weights skips weights with such uses; reaching here is a bug
                raise RuntimeError(f"{target.fqn}: cannot route {user.format_node()} through nmsparse ops")
            w, wd = weight, dgrad
            if ops["kind"] == "linear":
                if ops["transposed"]:
                    w, wd = _transposed(graph, weight, cache), _transposed(graph, dgrad, cache)
                op = torch.ops.nmsparse.linear.default
                args = (ops["x"], w, wd, ops["bias"], mvue_n, mvue_m, bool(getattr(recipe, "fp8", False)))
            else:
                op = torch.ops.nmsparse.conv.default
                args = (ops["x"], w, wd, ops["bias"], ops["stride"], ops["padding"], ops["dilation"],
                        ops["groups"], mvue_n, mvue_m)
            _graph.replace_call(user, op, args)
            count += 1
    graph.lint()
    gm.recompile()
    return count
