"""Where declarations live: a table on each owning module, keyed by parameter name.

A recipe record (:class:`nmcompile.annotate.WeightAnnotation`) or a deploy record
(:class:`nmcompile.finalize.Deployed`) belongs to the module that owns the weight, under the
parameter's attribute name, never to the ``nn.Parameter`` object. Whatever replaces parameter
objects keeps the declaration by construction: FSDP2's ``fully_shard`` (before or after
``annotate``), ``to_empty`` after meta-device construction, ``load_state_dict(assign=True)``,
``copy.deepcopy``, pickling, wrappers that keep the module. The two tables are plain dicts in the
module's ``__dict__`` (attributes :data:`RECIPES` and :data:`DEPLOYED`), so every one of those
copies them with the module.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = ["RECIPES", "DEPLOYED", "table", "get", "put", "drop", "owners", "root"]

RECIPES = "_nmcompile_recipes"  # {parameter attribute: WeightAnnotation}
DEPLOYED = "_nmcompile_deployed"  # {parameter attribute: Deployed}


def table(module: nn.Module, kind: str) -> dict:
    """The module's records of ``kind`` (:data:`RECIPES` or :data:`DEPLOYED`); empty if none (read only)."""
    return module.__dict__.get(kind) or {}


def get(module: nn.Module, kind: str, param_name: str):
    return table(module, kind).get(param_name)


def put(module: nn.Module, kind: str, param_name: str, record) -> None:
    records = module.__dict__.get(kind)
    if records is None:
        records = {}
        object.__setattr__(module, kind, records)  # a plain attribute: nn.Module.__setattr__ would check it
    records[param_name] = record


def drop(module: nn.Module, kind: str, param_name: str):
    """Remove and return the record (or None)."""
    records = module.__dict__.get(kind)
    return records.pop(param_name, None) if records else None


def root(model: nn.Module) -> nn.Module:
    """``model`` without ``torch.compile``'s wrapper, so that names carry no ``_orig_mod.``."""
    while type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def owners(model: nn.Module) -> Iterator[tuple[str, list[tuple[str, nn.Module, str]]]]:
    """Each distinct parameter once, with every (module name, module, attribute) that holds it."""
    holders: dict[int, list[tuple[str, nn.Module, str]]] = {}
    seen: set[tuple[int, str]] = set()
    for mname, module in root(model).named_modules(remove_duplicate=False):
        for pname, param in module._parameters.items():
            if param is None or (id(module), pname) in seen:
                continue
            seen.add((id(module), pname))
            holders.setdefault(id(param), []).append((mname, module, pname))
    for places in holders.values():
        mname, _, pname = places[0]
        yield (f"{mname}.{pname}" if mname else pname), places
