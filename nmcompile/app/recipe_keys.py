"""``nmcompile recipes``: each recipe's own keys, spelled the way the recipe-string parser takes them.

A key is listed only where the recipe accepts a value other than its default (a one-shot recipe trains
nothing, so it takes no ``wgrad``); booleans are written ``on``/``off``; a key the recipe cannot be built
without is marked required.
"""

from __future__ import annotations

import dataclasses

from ..recipes import RECIPES
from ..recipes.base import WGRAD_CHOICES

__all__ = ["recipe_keys", "recipe_lines"]


def _spelled(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)  # an optional key left out, as a spec writes it


def _builds(cls, **keys) -> bool:
    try:
        cls(**keys)
    except ValueError:
        return False
    return True


def _required(cls) -> set[str]:
    """The keys without which ``cls`` refuses to be built: each one that, given alone, lets it build."""
    if _builds(cls):
        return set()
    return {f.name for f in dataclasses.fields(cls)
            if f.name not in ("n", "m") and f.type == "int" and _builds(cls, **{f.name: 10})}


def _accepts(cls, key: str, value, required: set[str]) -> bool:
    return _builds(cls, **{name: 10 for name in required if name != key}, **{key: value})


def recipe_keys(name: str) -> list[str]:
    """``["key=default", "key (required)", "wgrad=dense (or mvue12, mvue24)", ...]`` of recipe ``name``."""
    cls = RECIPES[name]
    required = _required(cls)
    keys = []
    for field in dataclasses.fields(cls):
        if field.name in ("n", "m"):
            continue
        if field.name in required:
            keys.append(f"{field.name} (required)")
        elif field.name == "wgrad":
            others = [choice for choice in WGRAD_CHOICES if choice != field.default]
            if any(_accepts(cls, "wgrad", choice, required) for choice in others):
                keys.append(f"wgrad={field.default} (or {', '.join(others)})")
        else:
            keys.append(f"{field.name}={_spelled(field.default)}")
    return keys


def recipe_lines() -> list[str]:
    """One line per recipe: ``NAME:N:M  key=default, ...`` (``one shot`` marks the calibrated recipes)."""
    lines = []
    for name, cls in RECIPES.items():
        keys = ", ".join(recipe_keys(name)) or "no keys"
        kind = "  [one shot: calibrate, then nmcompile.finalize]" if cls.calibrated else ""
        lines.append(f"{name}:N:M  {keys}{kind}")
    lines.append("Write a recipe as NAME:N:M[,key=value]..., e.g. sr_ste:2:4,decay=1e-4 or sparsegpt:2:4,update=off")
    return lines
