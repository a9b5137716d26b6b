"""Declarations (annotate, backend options, NMSPARSE_RECIPE, TOML files) as one ordered rule list.

A rule maps a glob over parameter or module names to a recipe, or to ``"dense"`` to keep a weight
dense. **The first rule that matches a weight wins**; ``include``/``exclude`` filter before any
rule is looked at. Output heads and MoE routers stay dense unless a rule or ``include`` names them
(see :mod:`nmcompile.declare.defaults`; ``default_dense`` replaces those globs, ``[]`` turns them off).
A TOML rules file looks like::

    include = ["encoder.*"]          # optional
    exclude = ["*.classifier.*"]     # optional
    default_dense = []               # optional: let catch-all rules reach heads and routers
    [rules]                          # in order, first match wins
    "*.fc1.weight" = "s_ste:2:4"
    "*.attn.*" = "dense"
    "*" = "sr_ste:2:4,decay=2e-4"

``recipe = "..."`` at the top level is short for a last rule ``"*" = "..."``.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from .. import recipes
from ..recipes.base import Recipe, nearest
from .defaults import DEFAULT_DENSE, default_reason, names_explicitly

__all__ = ["Rule", "Plan", "ENV_VAR"]

ENV_VAR = "NMSPARSE_RECIPE"
_DENSE = ("dense", "none")
_TOML_KEYS = ("recipe", "include", "exclude", "default_dense", "rules")


@dataclass(frozen=True)
class Rule:
    glob: str
    recipe: Recipe | None  # None keeps matching weights dense


def _recipe_or_dense(value) -> Recipe | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _DENSE):
        return None
    return recipes.parse(value)


def _globs(value, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"{what} takes a glob or a list of globs over parameter/module names, got {value!r}")


def _closest(glob: str, candidates: list[str]) -> str:
    """``"; the closest: ..."`` for a glob that matched none of ``candidates`` (``""`` if none is close)."""
    deeper = [n for n in candidates if fnmatchcase(n, f"*.{glob}")]
    if deeper:
        shown = ", ".join(map(repr, deeper[:3])) + (" ..." if len(deeper) > 3 else "")
        return f"; it is the end of {shown}: a glob names a whole name, write '*.{glob}' to match it at any depth"
    close = difflib.get_close_matches(glob, candidates, n=3, cutoff=0.5)
    return f"; the closest names: {', '.join(map(repr, close))}" if close else ""


def _names(param_name: str) -> tuple[str, str]:
    return param_name, param_name.rpartition(".")[0]


@dataclass(frozen=True)
class Plan:
    """Ordered rules plus include/exclude filters; see the module docstring."""

    rules: tuple[Rule, ...]
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    default_dense: tuple[str, ...] = DEFAULT_DENSE  # heads and routers; see nmcompile.declare.defaults
    default_dense_given: bool = False  # the declaration set default_dense itself

    def _rule_for(self, param_name: str) -> Rule | None:
        names = _names(param_name)
        if self.include and not any(fnmatchcase(n, g) for g in self.include for n in names):
            return None
        if any(fnmatchcase(n, g) for g in self.exclude for n in names):
            return None
        for rule in self.rules:
            if any(fnmatchcase(n, rule.glob) for n in names):
                return rule
        return None

    def recipe_for(self, param_name: str, shape=None) -> Recipe | None:
        """The recipe for parameter ``param_name`` (e.g. ``"encoder.0.fc1.weight"``, of ``shape``
        where known: a router is told from a gated MLP's ``gate`` by it), or None."""
        rule = self._rule_for(param_name)
        if rule is None or self.kept_by_default(param_name, shape, rule) is not None:
            return None
        return rule.recipe

    def kept_by_default(self, param_name: str, shape=None, rule: Rule | None = None) -> str | None:
        """Why a catch-all rule that selects ``param_name`` does not reach it (an output head or a
        MoE router not named by the rule or an include), or None."""
        rule = rule or self._rule_for(param_name)
        if rule is None or rule.recipe is None:
            return None
        if names_explicitly(rule.glob, param_name) or any(names_explicitly(g, param_name) for g in self.include):
            return None
        return default_reason(param_name, shape, self.default_dense)

    def filtered_out(self, param_name: str, shape=None) -> str | None:
        """Why include/exclude or the dense defaults leave ``param_name`` out, or None."""
        names = _names(param_name)
        if self.include and not any(fnmatchcase(n, g) for g in self.include for n in names):
            return f"not matched by include={list(self.include)}"
        for g in self.exclude:
            if any(fnmatchcase(n, g) for n in names):
                return f"matched by exclude glob {g!r}"
        return self.kept_by_default(param_name, shape)

    def why_none(self, names) -> str | None:
        """Why this plan selects no weight among ``names`` (parameter names), or None if it selects
        one or keeps one dense by an explicit rule."""
        names = list(names)
        for name in names:
            if self.filtered_out(name) is None and any(
                fnmatchcase(n, rule.glob) for rule in self.rules for n in _names(name)
            ):
                return None
        reasons = []
        if not self.rules:
            reasons.append("it has no rules (an empty rules file?)")
        for glob in self.include:
            if not any(fnmatchcase(n, glob) for name in names for n in _names(name)):
                reasons.append(f"include glob {glob!r} matches none of them")
        for glob in self.exclude:
            hit = sum(any(fnmatchcase(n, glob) for n in _names(name)) for name in names)
            if hit:
                reasons.append(f"exclude glob {glob!r} removes {hit} of them")
        for rule in self.rules:
            if not any(fnmatchcase(n, rule.glob) for name in names for n in _names(name)):
                reasons.append(f"rule {rule.glob!r} matches none of them")
        return "; ".join(reasons) or "no rule matches a weight that include/exclude leave in"

    def unmatched_filters(self, names) -> list[str]:
        """One line for each include/exclude glob that matches none of ``names`` (parameter names) nor
        their modules' names, with the closest names (a glob names a whole name: ``fc3`` is not
        ``module.fc3``)."""
        candidates = list(dict.fromkeys(n for name in names for n in _names(name) if n))
        lines = []
        for kind, globs in (("include", self.include), ("exclude", self.exclude)):
            for glob in globs:
                if not any(fnmatchcase(n, glob) for n in candidates):
                    lines.append(f"{kind} glob {glob!r} matches no parameter or module name{_closest(glob, candidates)}")
        return lines

    @classmethod
    def build(cls, spec, *, include=None, exclude=None, default_dense=None) -> Plan:
        """A plan from a recipe (object or string), a TOML path, a ``{glob: recipe}`` mapping,
        a list of ``(glob, recipe)`` pairs, or another plan. ``default_dense`` (globs over module
        names) replaces the built-in heads-and-routers globs; ``[]`` turns them off."""
        inc, exc = _globs(include, "include"), _globs(exclude, "exclude")
        if isinstance(spec, Plan):
            base = spec
        elif isinstance(spec, os.PathLike) or (isinstance(spec, str) and spec.strip().endswith(".toml")):
            base = cls.from_toml(spec)
        elif isinstance(spec, (Recipe, str)):
            base = cls((Rule("*", _recipe_or_dense(spec)),))
        elif isinstance(spec, Mapping):
            base = cls(tuple(Rule(str(g), _recipe_or_dense(r)) for g, r in spec.items()))
        elif isinstance(spec, Sequence) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in spec):
            base = cls(tuple(Rule(str(g), _recipe_or_dense(r)) for g, r in spec))
        else:
            raise TypeError(
                "recipe_or_rules takes a recipe ('sr_ste:2:4' or nmcompile.recipes.SRSTE()), a TOML "
                f"file path, a {{glob: recipe}} dict or a list of (glob, recipe) pairs; got {spec!r}"
            )
        if default_dense is None:
            return cls(base.rules, base.include + inc, base.exclude + exc, base.default_dense, base.default_dense_given)
        return cls(base.rules, base.include + inc, base.exclude + exc, _globs(default_dense, "default_dense"), True)

    @classmethod
    def from_toml(cls, path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"rules file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"rules file {str(path)!r} is not valid TOML: {err}") from None
        for key in data:
            if key not in _TOML_KEYS:
                raise ValueError(
                    f"rules file {str(path)!r}: unknown key {key!r}{nearest(key, _TOML_KEYS)}; "
                    f"accepted: {', '.join(_TOML_KEYS)}"
                )
        table = data.get("rules", {})
        if not isinstance(table, Mapping):
            raise ValueError(f"rules file {str(path)!r}: [rules] must be a table of glob = recipe")
        rules = [Rule(g, _recipe_or_dense(r)) for g, r in table.items()]
        if "recipe" in data:
            rules.append(Rule("*", _recipe_or_dense(data["recipe"])))
        plan = cls(tuple(rules), _globs(data.get("include"), "include"), _globs(data.get("exclude"), "exclude"))
        if "default_dense" in data:
            plan = cls(plan.rules, plan.include, plan.exclude, _globs(data["default_dense"], "default_dense"), True)
        return plan

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Plan | None:
        """The plan in ``NMSPARSE_RECIPE`` (a recipe string or a TOML path), or None if unset."""
        value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        if not value:
            return None
        try:
            return cls.build(value)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{ENV_VAR}={value!r}: {err}") from None
