"""``with nmcompile.region(recipe):`` marks a region of model code for a recipe."""

from __future__ import annotations

import torch.fx.traceback as fx_traceback

from .. import recipes
from ..recipes.base import Recipe

__all__ = ["region"]


def _canonical(recipe: Recipe | str) -> str:
    # Evaluated once while Dynamo traces, so the parsing never enters the graph.
    if isinstance(recipe, str) and recipe.strip().lower() == "dense":
        return "dense"
    return str(recipes.parse(recipe))


# what ``torch.compiler.assume_constant_result`` does, without importing Dynamo with nmcompile (about
# 2.5 s of every process's start-up, serving processes included); tests/declare hold the two equal
_canonical._dynamo_marked_constant = True


def region(recipe: Recipe | str):
    """Weights consumed by linear/conv calls inside the block get ``recipe`` under ``nmsparse``.

    Uses ``torch.fx.traceback.annotate``: Dynamo records the recipe on the nodes it traces in the
    block (no graph break); eager execution is unaffected. ``"dense"`` opts a region out. A region
    recipe comes after ``nmcompile.annotate`` and before backend options in precedence.
    """
    return fx_traceback.annotate({"nmcompile": _canonical(recipe)})
