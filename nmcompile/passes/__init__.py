"""Graph passes over Dynamo's torch-level graph. See README.md in this folder for the invariants."""

from __future__ import annotations

import logging

from torch import fx

from .context import NMTarget, PassContext
from .find_nm_weights import find_nm_weights
from .insert_nm_projections import insert_nm_projections

__all__ = ["PassContext", "NMTarget", "TRAIN_PASSES", "run_passes"]

log = logging.getLogger("nmcompile")

#: Training: find the weights and their recipes, then insert the recipe ops.
TRAIN_PASSES = (find_nm_weights, insert_nm_projections)


def run_passes(gm: fx.GraphModule, passes, ctx: PassContext) -> PassContext:
    done = []
    for graph_pass in passes:
        try:
            count = graph_pass(gm, ctx)
        except Exception as err:
            raise RuntimeError(
                f"nmcompile pass {graph_pass.__name__} failed (after {done or 'no passes'}): {err}"
            ) from err
        log.debug("%s: %d", graph_pass.__name__, count)
        done.append(graph_pass.__name__)
    return ctx
