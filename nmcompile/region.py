"""``with nmcompile.region(recipe):`` marks a region of model code for a recipe."""

from __future__ import annotations

import contextlib

import torch.fx.traceback as fx_traceback

from . import recipes
from .recipes.base import Recipe

__all__ = ["region"]


@contextlib.contextmanager
def region(recipe: Recipe | str):
    """Weights consumed by linear/conv calls inside the block get ``recipe`` under ``nmsparse``.

    Uses ``torch.fx.traceback.annotate``: Dynamo records the recipe on the nodes it traces in the
    block (no graph break); eager execution is unaffected. ``"dense"`` opts a region out.
    """
    if isinstance(recipe, str) and recipe.strip().lower() == "dense":
        text = "dense"
    else:
        text = str(recipes.parse(recipe))
    with fx_traceback.annotate({"nmcompile": text}):
        yield
