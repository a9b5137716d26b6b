"""Node matching shared by the passes: the one place that knows Dynamo's torch-level IR."""

from __future__ import annotations

import operator
import re

import torch
import torch.nn.functional as F
from torch import fx, nn

# call targets that take a weight as their second argument and reduce its dim 1
_LINEAR = {torch._C._nn.linear, F.linear}
_CONV = {torch.conv1d, torch.conv2d, F.conv1d, F.conv2d}
_MATMUL = (torch.matmul, torch.mm, operator.matmul)
_EMBEDDING = {torch.embedding, F.embedding, F.embedding_bag}
# Dynamo keeps F.multi_head_attention_forward as one call; every projection weight it takes is
# [out, in] and goes through linear inside: in_proj_weight is argument 5, out_proj_weight 11.
_MHA_POSITIONS = (5, 11)
_MHA_KEYWORDS = ("in_proj_weight", "out_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


#: ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)`` as Dynamo records it: a call
#: ``tag_activation_checkpoint(body, *args)`` whose body (a submodule) receives the weights as inputs
_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def checkpoint_inputs(user: fx.Node, value: fx.Node) -> tuple[fx.GraphModule, list[fx.Node]] | None:
    """For an activation-checkpoint call ``user`` that takes ``value``: its body and the body's
    placeholders that receive ``value``; None for any other node."""
    if user.op != "call_function" or user.target is not _CHECKPOINT or not user.args:
        return None
    body_node = user.args[0]
    if not isinstance(body_node, fx.Node) or body_node.op != "get_attr":
        return None
    body = getattr(user.graph.owning_module, body_node.target)
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    return body, [placeholders[i] for i, arg in enumerate(user.args[1:]) if arg is value and i < len(placeholders)]


def leaf_uses(user: fx.Node, weight: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """``[(node, the node it reads the weight through)]``: ``(user, weight)``, or, for an activation
    checkpoint, the uses of the weight inside its body (recursively)."""
    inside = checkpoint_inputs(user, weight)
    if inside is None:
        return [(user, weight)]
    return [pair for inner in inside[1] for use in list(inner.users) for pair in leaf_uses(use, inner)]


def weight_use(user: fx.Node, weight: fx.Node) -> tuple[str, int | None]:
    """How ``user`` consumes ``weight``: ``(kind, reduction dim of the weight)``.

    kind is ``"gemm"`` (linear, addmm, matmul, conv with the weight as the weight operand; also an
    activation checkpoint whose body uses it only so, along one dim), ``"embedding"``, or the name
    of any other op (which nmcompile does not rewrite through).
    """
    if checkpoint_inputs(user, weight) is not None:
        uses = {weight_use(node, inner) for node, inner in leaf_uses(user, weight)}
        if len(uses) == 1 and next(iter(uses))[0] == "gemm":
            return uses.pop()
        kinds = sorted(kind for kind, _ in uses if kind != "gemm") or ["GEMMs of two reduction dims"]
        return f"{kinds[0]} inside torch.utils.checkpoint", None
    target = user.target
    args = user.args
    if user.op == "call_function":
        if target in _LINEAR and len(args) > 1 and args[1] is weight and args[0] is not weight:
            return "gemm", 1  # linear(x, W[out, in])
        if target in _CONV and len(args) > 1 and args[1] is weight and args[0] is not weight:
            return "gemm", 1  # conv(x, W[out, in, k...]): input channels
        if target is torch.addmm and len(args) > 2 and args[2] is weight and weight not in args[:2]:
            return "gemm", 0  # GPT-2 Conv1D: addmm(bias, x, W[in, out])
        if target in _MATMUL and len(args) == 2 and args[0] is not args[1]:
            if args[1] is weight:
                return "gemm", 0  # x @ W[in, out]
            if args[0] is weight:
                return "gemm", 1  # W[out, in] @ x
        if target in _EMBEDDING:
            return "embedding", None
        if target is F.multi_head_attention_forward and weight not in args[:3]:
            if any(i < len(args) and args[i] is weight for i in _MHA_POSITIONS) or any(
                user.kwargs.get(key) is weight for key in _MHA_KEYWORDS
            ):
                return "gemm", 1
    name = getattr(target, "__name__", str(target))
    return f"{user.op} {name}", None


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


def _frame_value(source):
    """The object ``source`` names in the frame Dynamo is compiling, or None.

    A Dynamo source's name is the Python expression its guards evaluate, over the frame's locals
    ``L`` and globals ``G`` (``L['self']._modules['fc1']``); the backend runs while Dynamo still
    holds that frame.
    """
    from torch._dynamo import symbolic_convert

    tx = getattr(symbolic_convert.tls, "current_tx", None)
    frame = getattr(getattr(tx, "output", None), "root_tx", None)
    if frame is None:
        return None
    try:
        return eval(source_name(source), {"__builtins__": {}}, {"L": frame.f_locals, "G": frame.f_globals})
    except Exception:  # a source form that is not a plain expression: the caller names the weight
        return None


def owning_module(source) -> tuple[nn.Module, str] | None:
    """``(module, attribute)`` that owns the parameter ``source`` names, or None if it cannot be told."""
    owner = owner_source(source)
    if owner is None:
        return None
    module = _frame_value(owner[0])
    if not isinstance(module, nn.Module) or owner[1] not in module._parameters:
        return None
    return module, owner[1]


def parameter_placeholders(gm: fx.GraphModule):
    """``(node, parameter, dynamo source)`` for every placeholder that is an ``nn.Parameter``."""
    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        if grapharg is None or grapharg.source is None:
            continue
        example = grapharg.example
        if isinstance(example, nn.Parameter):
            yield node, example, grapharg.source


def region_recipe(users) -> str | None:
    """The recipe a ``nmcompile.region`` put on any of ``users`` (``node.meta['custom']``)."""
    for user in users:
        custom = user.meta.get("custom") or {}
        if "nmcompile" in custom:
            return custom["nmcompile"]
    return None


def _ints(value, k: int) -> list[int] | None:
    if isinstance(value, int):
        return [value] * k
    if isinstance(value, (tuple, list)) and len(value) == k and all(isinstance(v, int) for v in value):
        return list(value)
    return None


def _conv_padding(padding, weight_shape, dilation: list[int]) -> list[int] | None:
    if padding == "valid":
        return [0] * len(dilation)
    if padding == "same":  # symmetric only: each side gets half of d * (k - 1)
        total = [d * (k - 1) for d, k in zip(dilation, weight_shape[2:])]
        return [t // 2 for t in total] if all(t % 2 == 0 for t in total) else None
    return _ints(padding, len(dilation))


def gemm_operands(user: fx.Node, weight: fx.Node) -> dict | None:
    """The operands of a GEMM/conv use of ``weight`` in the normalised form nmcompile's ops take.

    ``{"kind": "linear", "x", "bias", "transposed"}`` (``transposed``: the weight is ``[in, out]``)
    or ``{"kind": "conv", "x", "bias", "stride", "padding", "dilation", "groups"}``; None when the use
    has another form (nn.MultiheadAttention's fused call, scaled addmm, an unbatched conv input).
    """
    target, args, kwargs = user.target, user.args, user.kwargs
    if user.op != "call_function":
        return None
    if target in _LINEAR and args[1] is weight:
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return {"kind": "linear", "x": args[0], "bias": bias, "transposed": False}
    if target is torch.addmm and args[2] is weight and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
        return {"kind": "linear", "x": args[1], "bias": args[0], "transposed": True}
    if target in _MATMUL and len(args) == 2 and args[1] is weight and weight.meta["example_value"].dim() == 2:
        return {"kind": "linear", "x": args[0], "bias": None, "transposed": True}
    if target in _CONV and args[1] is weight:
        names = ("bias", "stride", "padding", "dilation", "groups")
        defaults = (None, 1, 0, 1, 1)
        values = [args[2 + i] if len(args) > 2 + i else kwargs.get(k, d) for i, (k, d) in enumerate(zip(names, defaults))]
        bias, stride, padding, dilation, groups = values
        w_shape = weight.meta["example_value"].shape
        k = len(w_shape) - 2
        x_val = args[0].meta.get("example_value") if isinstance(args[0], fx.Node) else None
        stride, dilation = _ints(stride, k), _ints(dilation, k)
        if x_val is None or x_val.dim() != k + 2 or stride is None or dilation is None or not isinstance(groups, int):
            return None
        padding = _conv_padding(padding, w_shape, dilation)
        if padding is None:
            return None
        return {"kind": "conv", "x": args[0], "bias": bias, "stride": stride, "padding": padding,
                "dilation": dilation, "groups": groups}
    return None


def own_checkpoint_body(user: fx.Node) -> fx.GraphModule:
    """The body of the activation checkpoint ``user`` as a copy that only this graph module holds.

    A graph module made from another (the backend's working copy of Dynamo's graph) shares its
    submodules; a pass that rewrites a body must not change the one Dynamo's graph keeps.
    """
    gm = user.graph.owning_module
    name = user.args[0].target
    body = getattr(gm, name)
    if getattr(body, "meta", {}).get("nmcompile_owner") == id(gm):
        return body
    graph = fx.Graph()
    val_map: dict = {}
    graph.output(graph.graph_copy(body.graph, val_map))
    copy = fx.GraphModule(body, graph)
    copy.meta.update(getattr(body, "meta", {}))
    copy.meta["nmcompile_owner"] = id(gm)  # not the module itself: that would register it as a submodule
    setattr(gm, name, copy)
    return copy


def add_input(graph: fx.Graph, after: fx.Node, name: str) -> fx.Node:
    """A placeholder made by the backend (no Dynamo source: the runner passes its value) after ``after``."""
    with graph.inserting_after(after):
        node = graph.placeholder(name)
    node._dynamo_source = None
    return node


def replace_call(node: fx.Node, target, args: tuple) -> fx.Node:
    """Replace ``node`` by ``target(*args)``, keeping its metadata and its users."""
    graph = node.graph
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new
