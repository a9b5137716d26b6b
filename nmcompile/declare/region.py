"""``with nmcompile.region(recipe):`` marks a region of model code for a recipe."""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback

from .. import recipes
from ..recipes.base import Recipe

__all__ = ["region"]


@torch.compiler.assume_constant_result
def _canonical(recipe: Recipe | str) -> str:
    # Evaluated once while Dynamo traces, so the parsing never enters the graph.
    if isinstance(recipe, str) and recipe.strip().lower() == "dense":
        return "dense"
    return str(recipes.parse(recipe))


def region(recipe: Recipe | str):
    """Weights consumed by linear/conv calls inside the block get ``recipe`` under ``nmsparse``.

    Uses ``torch.fx.traceback.annotate``: Dynamo records the recipe on the nodes it traces in the
    block (no graph break); eager execution is unaffected. ``"dense"`` opts a region out. A region
    recipe comes after ``nmcompile.annotate`` and before backend options in precedence.
    """
    return fx_traceback.annotate({"nmcompile": _canonical(recipe)})
