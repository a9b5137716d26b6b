"""Graph passes over Dynamo's torch-level graph. See README.md in this folder for the invariants."""

from __future__ import annotations

import logging

from torch import fx

from .context import NMTarget, PassContext
from .find_deployed_weights import find_deployed_weights
from .find_nm_weights import find_nm_weights
from .insert_calibration_stats import insert_calibration_stats
from .insert_nm_projections import insert_nm_projections
from .mask_adapter_updates import mask_adapter_updates
from .rewrite_nm_consumers import rewrite_nm_consumers
from .rewrite_sparse_gemms import rewrite_sparse_gemms
from .rewrite_sparse_training_gemms import rewrite_sparse_training_gemms
from .save_dgrad_weights import save_dgrad_weights

__all__ = ["PassContext", "NMTarget", "TRAIN_PASSES", "REWRITE_PASSES", "DEPLOY_PASSES", "run_passes"]

log = logging.getLogger("nmcompile")

#: Rewrite known targets: insert the recipe ops (and one-shot recipes' calibration op; LoRA updates masked by them), give GEMMs the recipe's backward, compute
#: separate DGRAD weights in the forward, and move the GEMMs whose operands are 2:4 to 2:4 kernels.
REWRITE_PASSES = (insert_nm_projections, mask_adapter_updates, insert_calibration_stats, rewrite_nm_consumers, save_dgrad_weights, rewrite_sparse_training_gemms)
#: Training: find the weights and their recipes, then rewrite.
TRAIN_PASSES = (find_nm_weights, *REWRITE_PASSES)
#: Finalized models: decide each deployed weight's kernel, then rewrite its linears to it.
DEPLOY_PASSES = (find_deployed_weights, rewrite_sparse_gemms)


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
