"""The ``nmsparse`` backend's deploy route: finalized models get fused 2:4 GEMMs.

Runs :data:`nmcompile.passes.DEPLOY_PASSES` (per-layer decision, then the rewrite to
``nmsparse::sparse_linear``), compiles the result, and returns a callable that appends each
sparse layer's compressed weight to the inputs. Weights are compressed when the graph is
compiled and again only when a weight tensor changes (its version counter), or when another
instance of the model class runs through the same graph.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import fx

from ..kernels.dispatch import DECISION_ATTR
from ..kernels.inductor import compress

log = logging.getLogger("nmcompile")

__all__ = ["DeployRunner", "record_decisions"]


def record_decisions(ctx) -> None:
    """Put each layer's decision on its parameter (read by :func:`nmcompile.deploy_report`) and log it."""
    for target in ctx.deployed:
        setattr(target.param, DECISION_ATTR, target.decision)
        log.info("nmsparse deploy: %s -> %s", target.fqn, target.decision)


class DeployRunner:
    """Calls the compiled deploy graph with the compressed weights of the instance being run."""

    def __init__(self, gm: fx.GraphModule, ctx, compiled, n_inputs: int):
        placeholders = [node.name for node in gm.graph.find_nodes(op="placeholder")]
        self.compiled, self.n_inputs = compiled, n_inputs
        sparse = [t for t in ctx.deployed if t.decision.sparse]
        # per sparse weight: (its position among the inputs, kernel, decision, stored [in, out])
        self.layers = [(placeholders.index(t.node.name), t.decision.kernel, t.decision, t.transposed) for t in sparse]
        # id(weight) -> (weakref, version, values, meta)
        self.cache: dict[int, tuple] = {}
        for t in sparse:  # compressed once by the rewrite pass
            values, meta = ctx.compressed[t.fqn]
            self.cache[id(t.param)] = (weakref.ref(t.param), t.param._version, values, meta)

    def _packed(self, weight: torch.Tensor, kernel: str, decision, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self.cache.get(id(weight))
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2], hit[3]
        if hit is not None and hit[0]() is weight:
            log.warning("nmsparse deploy: a finalized weight %s changed; compressing it again", tuple(weight.shape))
        values, meta = compress(weight.t() if transposed else weight, kernel)  # raises if no longer 2:4
        self.cache[id(weight)] = (weakref.ref(weight), weight._version, values, meta)
        if getattr(weight, DECISION_ATTR, None) is None:
            setattr(weight, DECISION_ATTR, decision)
        return values, meta

    def __call__(self, *args):
        inputs = list(args)
        for index, kernel, decision, transposed in self.layers:
            inputs.extend(self._packed(args[index], kernel, decision, transposed))
        return self.compiled(*inputs)
