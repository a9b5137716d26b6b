"""Rewrite each finalized 2:4 linear to ``nmsparse::sparse_linear`` with its weight compressed once.

For every deployed weight whose decision is a sparse kernel, adds two placeholders (the
compressed values and metadata; the backend passes them on every call, compressed when the graph
is compiled and again only if the weight changes) and replaces each ``F.linear(x, W, b)`` with
``nmsparse::sparse_linear(x, W, values, meta, b, kernel, alg_id, min_tokens)``. On CUDA the
decision is first confirmed by timing (:func:`nmcompile.backends.dispatch.measure`).
"""

from __future__ import annotations

import torch
from torch import fx

from ..backends.dispatch import measure
from ..backends.inductor import compress
from .context import PassContext


def _tokens(x: fx.Node) -> int | None:
    value = x.meta.get("example_value")
    if value is None:
        return None
    count = 1
    for size in value.shape[:-1]:
        if not isinstance(size, int):
            return None  # dynamic
        count *= size
    return count


def rewrite_sparse_gemms(gm: fx.GraphModule, ctx: PassContext) -> int:
    graph = gm.graph
    last = list(graph.find_nodes(op="placeholder"))[-1]
    rewritten = 0
    for i, target in enumerate(ctx.deployed):
        decision = target.decision
        if not decision.sparse:
            continue
        values, meta = compress(target.param, decision.kernel)
        if decision.kernel == "cusparselt":
            tokens = {_tokens(use.args[0]) for use in target.uses}
            decision = measure(decision, target.param, target.bias, values, tokens.pop() if len(tokens) == 1 else None,
                               target.param.shape[1])
            ctx.deployed[i] = type(target)(**{**target.__dict__, "decision": decision})
            if not decision.sparse:
                continue
        names = []
        for part, example in (("values", values), ("meta", meta)):
            with graph.inserting_after(last):
                last = graph.placeholder(f"nm_{part}_{i}")
            last._dynamo_source = None  # a backend-made input: no Dynamo source, passed in by the runner
            last.meta["example_value"] = example
            names.append(last)
        ctx.compressed[target.fqn] = (values, meta)
        for use in target.uses:
            x = use.args[0]
            bias = use.args[2] if len(use.args) > 2 else use.kwargs.get("bias")
            with graph.inserting_before(use):
                new = graph.call_function(
                    torch.ops.nmsparse.sparse_linear.default,
                    (x, target.node, names[0], names[1], bias, decision.kernel, decision.alg_id, decision.min_tokens),
                )
            new.meta.update(use.meta)
            use.replace_all_uses_with(new)
            graph.erase_node(use)
            rewritten += 1
    graph.lint()
    gm.recompile()
    return rewritten
