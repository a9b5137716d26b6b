"""Insert the calibration op of one-shot recipes (Wanda, SparseGPT) before each GEMM of their weights.

    linear(x, w)  ->  nmsparse::accumulate_stats(x.detach(), stat, count, None, "rows", -1, [], gram)
                      linear(x, w)

``stat`` and ``count`` are the recipe state placeholders :mod:`.insert_nm_projections` added; the op
mutates them, so the compiled graph updates the module's buffers at every call (also under
``torch.no_grad()`` and in ``eval()``, which is how a calibration pass runs). Each GEMM contributes the
rows that really reach the weight: for stacked (expert) weights, per expert, only the tokens routed
to it (``W[e]``, ``W[ids]``, a grouped GEMM's ``offs``). Which operand that is comes from
:func:`.matching.calibration_routes.calibration_routes`; :mod:`.find_nm_weights` has already named the weights whose
inputs it cannot read.
"""

from __future__ import annotations

import torch
from torch import fx

from .. import ops  # noqa: F401  (registers nmsparse::accumulate_stats)
from .matching import calibration_routes
from .context import PassContext

_OP = torch.ops.nmsparse.accumulate_stats.default


def insert_calibration_stats(gm: fx.GraphModule, ctx: PassContext) -> int:
    inserted = 0
    for target in ctx.targets:
        if not getattr(target.recipe, "calibrated", False):
            continue
        stat, count = ctx.state_nodes[target.fqn]
        routes = calibration_routes.calibration_routes(target.node, target.dim)
        if isinstance(routes, str):  # find_nm_weights checks this first
            raise RuntimeError(f"{target.fqn}: {routes}")
        for route in routes:
            gemm, x = route["gemm"], route["x"]
            graph = gemm.graph
            with graph.inserting_before(gemm):
                detached = graph.call_method("detach", (x,))
                detached.meta["example_value"] = x.meta["example_value"].detach()
                call = graph.call_function(_OP, (detached, stat, count, route["route"], route["layout"],
                                                 route["expert"], route["conv"], target.recipe.gram))
                call.meta["example_value"] = None
            inserted += 1
    if inserted:
        gm.graph.lint()
        gm.recompile()
    return inserted
