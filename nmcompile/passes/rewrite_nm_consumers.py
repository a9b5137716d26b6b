"""Route GEMMs whose backward a recipe changes through nmcompile's GEMM ops.

    linear(x, w_nm, b)   ->  nmsparse::linear(x, w_nm, w_dgrad, b, mvue_n, mvue_m, fp8)
    addmm(b, x, w_nm)    ->  nmsparse::linear(x, w_nm.t(), w_dgrad.t(), b, ...)   (weight [in, out])
    conv2d(x, w_nm, ...) ->  nmsparse::conv(x, w_nm, w_dgrad, b, stride, padding, dilation, groups, ...)

Inside ``torch.utils.checkpoint`` (Dynamo's ``tag_activation_checkpoint`` call, which receives the
projected weight as an input) the GEMMs of its body are rewritten, in a copy of the body.

Only for targets whose recipe sets ``wgrad="mvue12"/"mvue24"``, ``fp8`` or a separate DGRAD weight
(Bi-Mask); every other GEMM keeps aten's backward. Runs after :mod:`.insert_nm_projections`, which
records each target's projected and DGRAD weight nodes and the model's uses in ``ctx.projected``.
"""

from __future__ import annotations

import torch
from torch import fx

from .matching import gemm_uses
from .context import PassContext


def _transposed(graph: fx.Graph, node: fx.Node, cache: dict) -> fx.Node:
    if node not in cache:
        with graph.inserting_after(node):
            cache[node] = graph.call_function(torch.t, (node,))
        cache[node].meta["example_value"] = node.meta["example_value"].t()
    return cache[node]


def _rewrite(graph: fx.Graph, user: fx.Node, weight: fx.Node, dgrad: fx.Node, recipe, fqn: str, cache: dict) -> int:
    """Route ``user``'s GEMM on ``weight`` through nmsparse's op; inside an activation checkpoint's
    body when ``user`` is one (the DGRAD weight then enters the body as one more input)."""
    if gemm_uses.checkpoint_inputs(user, weight) is not None:
        body = gemm_uses.own_checkpoint_body(user)
        inner = gemm_uses.checkpoint_inputs(user, weight)[1]
        inner_dgrad = None
        if dgrad is not weight:
            last = list(body.graph.find_nodes(op="placeholder"))[-1]
            with body.graph.inserting_after(last):
                inner_dgrad = body.graph.placeholder(f"nm_dgrad_{fqn.replace('.', '_')}")
            inner_dgrad.meta["example_value"] = dgrad.meta["example_value"]
            user.args = (*user.args, dgrad)
        count = 0
        for node in inner:
            for use in list(node.users):
                count += _rewrite(body.graph, use, node, inner_dgrad or node, recipe, fqn, {})
        body.graph.lint()
        body.recompile()
        return count
    ops = gemm_uses.gemm_operands(user, weight)
    if ops is None:  # find_nm_weights skips weights with such uses; reaching here is a bug
        raise RuntimeError(f"{fqn}: cannot route {user.format_node()} through nmsparse ops")
    mvue_n, mvue_m = recipe.mvue or (0, 0)
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
    gemm_uses.replace_call(user, op, args)
    return 1


def rewrite_nm_consumers(gm: fx.GraphModule, ctx: PassContext) -> int:
    graph = gm.graph
    count = 0
    for target in ctx.targets:
        recipe = target.recipe
        if not recipe.rewrites_consumer:
            continue
        weight, dgrad, uses = ctx.projected[target.fqn]
        dgrad = dgrad if dgrad is not None else weight
        cache: dict = {}
        for user in uses:
            count += _rewrite(graph, user, weight, dgrad, recipe, target.fqn, cache)
    graph.lint()
    gm.recompile()
    return count
