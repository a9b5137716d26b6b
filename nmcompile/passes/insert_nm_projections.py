"""Insert each target weight's recipe projection and route every use through it.

    linear(x, w)  ->  w_nm = nmsparse::<op>(w, *state); linear(x, w_nm)

Recipe state becomes new placeholders appended after the existing ones (their values are passed
in at run time from the weight's module, see :mod:`nmcompile.backends.nmsparse`). The ops are
emitted by calling the recipe's own ``project`` on FX proxies, so the graph and
``nmcompile.effective_weights`` share one definition.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.proxy import GraphAppendingTracer

from .matching import gemm_uses
from .context import PassContext


def insert_nm_projections(gm: fx.GraphModule, ctx: PassContext) -> int:
    if not ctx.targets:
        return 0
    graph = gm.graph
    model_users = {t.fqn: set(t.node.users) for t in ctx.targets}
    tracer = GraphAppendingTracer(graph)
    last = list(graph.find_nodes(op="placeholder"))[-1]
    fake_mode = ctx.targets[0].node.meta["example_value"].fake_mode
    for target in ctx.targets:
        weight_val = target.node.meta["example_value"]
        state_nodes = []
        for key in target.recipe.state_names:
            last = gemm_uses.add_input(graph, last, f"nm_state_{target.fqn.replace('.', '_')}_{key}")
            state_nodes.append(last)
        with fake_mode:
            state_vals = target.recipe.example_state(weight_val.detach(), target.dim)
        for key, node in zip(target.recipe.state_names, state_nodes):
            node.meta["example_value"] = state_vals[key]
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        weight_proxy = fx.Proxy(target.node, tracer)
        state_proxies = [fx.Proxy(n, tracer) for n in state_nodes]
        with graph.inserting_before(first_op):
            frame = {} if target.frame is None else {"frame": target.frame}
            projected = target.recipe.project(weight_proxy, *state_proxies, dim=target.dim, **frame).node
            dgrad = target.recipe.dgrad_weight(fx.Proxy(projected, tracer), *state_proxies, dim=target.dim)
            dgrad = None if dgrad is None else dgrad.node
        before = model_users[target.fqn]
        with fake_mode:
            for node in (projected, dgrad):
                if node is not None:
                    node.meta["example_value"] = torch.empty_like(weight_val)
        for user in before:  # the model's uses of the weight (not the recipe's own ops)
            user.replace_input_with(target.node, projected)
        ctx.projected[target.fqn] = (projected, dgrad, tuple(before))
        ctx.state_nodes[target.fqn] = tuple(state_nodes)
    graph.lint()
    gm.recompile()
    return len(ctx.targets)
