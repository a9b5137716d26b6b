"""Recipes: one frozen dataclass per file, looked up by snake-case name in :data:`RECIPES`.

String form: ``NAME[:N:M][,key=value]*``, e.g. ``sr_ste:2:4,decay=2e-4`` or ``s_ste:1:8``.
"""

from __future__ import annotations

import dataclasses

from .. import ops as _ops  # noqa: F401  registers the nmsparse:: ops the recipes' projections call
from .asp import ASP
from .base import Recipe, nearest
from .bi_mask import BiMask
from .mdgf import MDGF
from .s_ste import SSTE
from .sdgf import SDGF
from .sparsegpt import SparseGPT
from .sr_ste import SRSTE
from .ste import STE
from .step import STEP
from .transposable import Transposable
from .wanda import Wanda

__all__ = [
    "Recipe", "STE", "SRSTE", "SSTE", "STEP", "MDGF", "SDGF", "BiMask", "Transposable", "ASP", "Wanda", "SparseGPT",
    "RECIPES", "parse", "get",
]

RECIPES: dict[str, type[Recipe]] = {
    "ste": STE,
    "sr_ste": SRSTE,
    "s_ste": SSTE,
    "step": STEP,
    "mdgf": MDGF,
    "sdgf": SDGF,
    "bi_mask": BiMask,
    "transposable": Transposable,
    "asp": ASP,
    "wanda": Wanda,
    "sparsegpt": SparseGPT,
}


def get(name: str, **overrides) -> Recipe:
    """The recipe registered as ``name`` with its fields set from ``overrides``."""
    cls = RECIPES.get(name)
    if cls is None:
        raise ValueError(
            f"unknown recipe {name!r}{nearest(name, RECIPES)}; accepted: {', '.join(RECIPES)}"
        )
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in overrides:
        if key not in fields:
            raise ValueError(
                f"unknown key {key!r} for recipe {name!r}{nearest(key, fields)}; "
                f"accepted: {', '.join(sorted(fields))}"
            )
    return cls(**overrides)


def _convert(cls: type[Recipe], key: str, text: str):
    field_type = {f.name: f.type for f in dataclasses.fields(cls)}.get(key, "str")
    kind = getattr(field_type, "__name__", str(field_type))
    if kind.endswith(" | None"):  # an optional key: "none" leaves it out, anything else is its type
        if text.lower() == "none":
            return None
        kind = kind[: -len(" | None")]
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool":
            lowered = text.lower()
            if lowered in ("1", "true", "on", "yes"):
                return True
            if lowered in ("0", "false", "off", "no"):
                return False
            raise ValueError(text)
    except ValueError:
        raise ValueError(
            f"recipe {cls.name!r}: {key}={text!r} is not a valid {kind}"
        ) from None
    return text


def parse(spec: str | Recipe) -> Recipe:
    """Parse ``NAME[:N:M][,key=value]*`` (or pass a recipe object through)."""
    if isinstance(spec, Recipe):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a recipe is a Recipe object or a string like 'sr_ste:2:4', got {spec!r}")
    head, *pairs = [part.strip() for part in spec.strip().split(",")]
    name, *nm = head.split(":")
    name = name.strip()
    cls = RECIPES.get(name)
    if cls is None:
        get(name)  # raises with the accepted names
    overrides: dict = {}
    if nm:
        if len(nm) != 2:
            raise ValueError(f"recipe {spec!r}: the pattern is written NAME:N:M, e.g. {name}:2:4")
        overrides["n"] = _convert(cls, "n", nm[0])
        overrides["m"] = _convert(cls, "m", nm[1])
    for pair in pairs:
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"recipe {spec!r}: expected key=value, got {pair!r}")
        key = key.strip()
        if key in ("n", "m"):
            nm_example = {"n": overrides.get("n", 2), "m": overrides.get("m", 4), key: value.strip()}
            raise ValueError(
                f"recipe {spec!r}: {key} is not a key; the pattern is written after the name as NAME:N:M, "
                f"e.g. {name}:{nm_example['n']}:{nm_example['m']}"
            )
        if key in overrides:
            raise ValueError(f"recipe {spec!r}: {key} is given twice; give each key once")
        overrides[key] = _convert(cls, key, value.strip())
    return get(name, **overrides)
