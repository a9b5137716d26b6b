"""Where a graph's parameters come from: Dynamo sources to names, owning modules and the compiled module.

A Dynamo source's name is the Python expression its guards evaluate over the compiled frame's
locals ``L`` and globals ``G`` (``L['self']._modules['fc1']._parameters['weight']``). The passes
read a weight's name and its owning module (where its recipe record lives) from it here.
"""

from __future__ import annotations

import re

from torch import fx, nn

_KEY = re.compile(r"\._(modules|parameters|buffers)\['([^']*)'\]|\.([A-Za-z_][A-Za-z0-9_]*)")


def source_name(source) -> str:
    name = source.name
    return name() if callable(name) else name


def parameter_fqn(source) -> str:
    """``L['self']._modules['fc']._parameters['weight']`` -> ``fc.weight``."""
    parts = []
    for modules_key, key, attr in _KEY.findall(source_name(source)):
        if modules_key:
            parts.append(key)
        elif attr not in ("_modules", "_parameters", "_buffers", "_orig_mod", "module"):
            parts.append(attr)
    return ".".join(parts)


def _unwrapped(source):
    """``source`` without wrappers that only mark it (FSDP2's ``FSDPNNModuleSource`` keeps its base's name)."""
    while source is not None and getattr(source, "base", None) is not None and source_name(source) == source_name(source.base):
        source = source.base
    return source


def owner_source(source):
    """``(source of the owning module, attribute name)`` of a parameter source, or None."""
    index = getattr(source, "index", None)
    params = _unwrapped(getattr(source, "base", None))
    if not isinstance(index, str) or params is None or getattr(params, "member", None) != "_parameters":
        return None
    module = getattr(params, "base", None)
    return (module, index) if module is not None else None


def _compiled_frame():
    """The frame Dynamo is compiling (the backend runs while Dynamo still holds it), or None."""
    from torch._dynamo import symbolic_convert

    tx = getattr(symbolic_convert.tls, "current_tx", None)
    return getattr(getattr(tx, "output", None), "root_tx", None)


def _frame_value(frame, source):
    """The object ``source`` names in ``frame``, or None.

    A Dynamo source's name is the Python expression its guards evaluate, over the frame's locals
    ``L`` and globals ``G`` (``L['self']._modules['fc1']``).
    """
    try:
        return eval(source_name(source), {"__builtins__": {}}, {"L": frame.f_locals, "G": frame.f_globals})
    except Exception:  # a source form that is not a plain expression: searched for below
        return None


def root_module(source) -> nn.Module | None:
    """The module at the root of a parameter's source (``L['self']``: the compiled module), or None."""
    while getattr(source, "base", None) is not None:
        source = source.base
    frame = _compiled_frame()
    value = _frame_value(frame, source) if frame is not None else None
    return value if isinstance(value, nn.Module) else None


def owning_module(source, param=None) -> tuple[nn.Module, str] | None:
    """``(module, attribute)`` that owns the parameter ``source`` names, or None if it cannot be told.

    The owner's source is evaluated in the compiled frame; failing that, the modules among the
    frame's locals are searched for the module holding ``param`` under that attribute.
    """
    owner = owner_source(source)
    frame = _compiled_frame()
    if owner is None or frame is None:
        return None
    module = _frame_value(frame, owner[0])
    if isinstance(module, nn.Module) and owner[1] in module._parameters:
        return module, owner[1]
    if param is not None:
        for value in frame.f_locals.values():
            if isinstance(value, nn.Module):
                for candidate in value.modules():
                    if candidate._parameters.get(owner[1]) is param:
                        return candidate, owner[1]
    return None


def parameter_placeholders(gm: fx.GraphModule):
    """``(node, parameter, dynamo source)`` for every placeholder that is an ``nn.Parameter``."""
    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        if grapharg is None or grapharg.source is None:
            continue
        example = grapharg.example
        if isinstance(example, nn.Parameter):
            yield node, example, grapharg.source
