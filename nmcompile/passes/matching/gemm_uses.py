"""Node matching shared by the passes: the one place that knows Dynamo's torch-level IR."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

# call targets that take a weight as their second argument and reduce its dim 1
_LINEAR = {torch._C._nn.linear, F.linear}
CONV = {torch.conv1d, torch.conv2d, F.conv1d, F.conv2d}
MATMUL = (torch.matmul, torch.mm, operator.matmul)
_EMBEDDING = {torch.embedding, F.embedding, F.embedding_bag}
# Dynamo keeps F.multi_head_attention_forward as one call; every projection weight it takes is
# [out, in] and goes through linear inside: in_proj_weight is argument 5, out_proj_weight 11.
_MHA_POSITIONS = (5, 11)
_MHA_KEYWORDS = ("in_proj_weight", "out_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
# GEMMs of stacked (expert) weights: (a, b) -> a @ b per expert, each operand's matrix its last two axes
_BATCHED_MM = {*MATMUL, torch.bmm}
_BATCHED_MM_METHODS = ("matmul", "bmm", "__matmul__")
# grouped GEMMs (x [tokens, in], W [E, in, out], offs): torch's, and transformers' fallback op for CPU
GROUPED_MM = {f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None}
GROUPED_MM_OPS = ("transformers::grouped_mm_fallback",)
# ops that multiply a weight in a way whose reduction dim nmcompile does not read (a stacked weight
# used by them is named, not guessed)
_OTHER_GEMMS = {torch.einsum, torch.tensordot, torch.baddbmm, torch.addbmm, F.bilinear}


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
        if target in CONV and len(args) > 1 and args[1] is weight and args[0] is not weight:
            return "gemm", 1  # conv(x, W[out, in, k...]): input channels
        if target is torch.addmm and len(args) > 2 and args[2] is weight and weight not in args[:2]:
            return "gemm", 0  # GPT-2 Conv1D: addmm(bias, x, W[in, out])
        if _is_stacked_value(weight):
            return _stacked_use(user, weight)
        if target in MATMUL and len(args) == 2 and args[0] is not args[1]:
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
    elif user.op == "call_method" and _is_stacked_value(weight):
        return _stacked_use(user, weight)
    return f"{user.op} {target_name(target)}", None


def target_name(target) -> str:
    return getattr(target, "__name__", str(target))


def op_name(target) -> str:
    """``namespace::op`` of a custom op call target (packet or overload), else ``""``."""
    name = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "_overloadpacket", None), "_qualified_op_name", None)
    return name or ""


# ---- stacked (expert) weights: [E, ..., a, b], one matrix per expert (see nmcompile.pattern)


def node_value(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_stacked_value(node: fx.Node) -> bool:
    value = node_value(node)
    return value is not None and value.dim() >= 3 and value.is_floating_point()


def batched_gemm_dim(user: fx.Node, operand: fx.Node) -> int | None:
    """The dim of ``operand`` (counted from the end) that ``user``'s GEMM reduces, or None when
    ``user`` is not such a GEMM of it.

    ``linear(x, V)``: -1. ``a @ b`` (matmul, bmm, grouped mm): -2 of ``b``, -1 of ``a``.
    """
    target, args = user.target, user.args  # a method call's self is args[0]
    if len(args) < 2 or (args[0] is operand) == (args[1] is operand):
        return None
    right = args[1] is operand
    ndim = node_value(operand).dim() if node_value(operand) is not None else 0
    if user.op == "call_function" and target in _LINEAR and right and ndim == 2:
        return -1  # linear(x, W[e]): W[e] is [out, in]
    batched = (user.op == "call_function" and target in _BATCHED_MM) or (
        user.op == "call_method" and target in _BATCHED_MM_METHODS
    )
    grouped = user.op == "call_function" and (target in GROUPED_MM or op_name(target) in GROUPED_MM_OPS)
    if batched and len(args) == 2 and ndim >= 2:
        return -2 if right else -1
    if grouped and ndim == 3:  # 2-D x 3-D (tokens grouped by offs) or 3-D x 3-D
        return -2 if right else -1
    return None


def is_gemm_like(user: fx.Node) -> bool:
    target = user.target
    if user.op == "call_method":
        return target in (*_BATCHED_MM_METHODS, "baddbmm", "addbmm")
    return user.op == "call_function" and (
        target in _BATCHED_MM or target in GROUPED_MM or target in _OTHER_GEMMS or target in _LINEAR
        or op_name(target) in GROUPED_MM_OPS
    )


def swaps_matrix_axes(user: fx.Node, operand: fx.Node) -> bool | None:
    """For a view of ``operand`` that keeps each expert's matrix in its last two axes: whether it
    swaps them (``transpose(-2, -1)``, ``permute(..., -1, -2)``); None for any other node.

    Views that only select experts (``W[e]``, ``W[expert_ids]``, ``select(0, e)``) swap nothing.
    """
    value, out = node_value(operand), node_value(user)
    if value is None or out is None or not user.args or user.args[0] is not operand or out.dim() < 2:
        return None
    if any(a is operand for a in user.args[1:]) or any(v is operand for v in user.kwargs.values()):
        return None
    ndim = value.dim()
    target, args = user.target, user.args
    name = target if user.op == "call_method" else target_name(target)
    last_two = {ndim - 2, ndim - 1}
    if name in ("transpose", "swapaxes", "swapdims") and len(args) == 3:
        if all(isinstance(a, int) for a in args[1:]) and {a % ndim for a in args[1:]} == last_two:
            return True
        return None
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        if all(isinstance(d, int) for d in dims) and len(dims) == ndim:
            dims = [d % ndim for d in dims]
            lead = list(range(ndim - 2))
            if dims == lead + [ndim - 2, ndim - 1]:
                return False
            if dims == lead + [ndim - 1, ndim - 2]:
                return True
        return None
    if name == "select" and len(args) == 3 and args[1] in (0, -ndim):
        return False
    if user.op == "call_function" and target is operator.getitem and len(args) == 2:
        index = args[1]
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if isinstance(index, (int, torch.SymInt)):
            return False  # W[e]
        index_value = node_value(index)
        if index_value is not None and not index_value.is_floating_point() and index_value.dtype is not torch.bool:
            return False  # W[expert_ids]: integer indices along the expert axis
    return None


def _stacked_use(user: fx.Node, operand: fx.Node) -> tuple[str, int | None]:
    """How ``user`` consumes a stacked weight (or a view of one): ``("gemm", dim counted from the
    end)`` through expert views and GEMMs; ``("gemm", None)`` when a GEMM is reached but its
    reduction dim cannot be told (an unrecognised GEMM, two different dims); else another kind."""
    dim = batched_gemm_dim(user, operand)
    if dim is not None:
        return "gemm", dim
    if is_gemm_like(user):
        return "gemm", None
    swap = swaps_matrix_axes(user, operand)
    if swap is None:
        return f"{user.op} {target_name(user.target)}", None
    uses = {_stacked_use(use, user) for use in user.users}
    gemm_dims = {d for kind, d in uses if kind == "gemm"}
    if not gemm_dims:
        kinds = sorted(kind for kind, _ in uses) or ["nothing"]
        return f"{kinds[0]} through {target_name(user.target)}", None
    if len(uses) > 1 or None in gemm_dims:
        return "gemm", None  # also another use, or two reduction dims: named by unknown_reduction
    (dim,) = gemm_dims
    return "gemm", (-3 - dim if swap else dim)  # a swap maps -1 <-> -2


def use_name(user: fx.Node, weight: fx.Node) -> str:
    """How ``user`` consumes ``weight``, in words for a report."""
    kind = weight_use(user, weight)[0]
    if kind == "gemm" and _is_stacked_value(weight):
        return f"a per-expert GEMM (through {user.op} {target_name(user.target)})"
    return kind


def unknown_reduction(users, weight: fx.Node) -> str | None:
    """Why the GEMM uses of a stacked weight have no single reduction dim, or None when they do."""
    for user in users:
        if weight_use(user, weight) == ("gemm", None):
            return (
                f"a stacked (expert) weight used through {user.format_node()}, where nmcompile cannot tell "
                "one reduction dimension (an op it does not read, two different dims, or another use of the "
                "same view)"
            )
    return None


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
    if target in MATMUL and len(args) == 2 and args[1] is weight and weight.meta["example_value"].dim() == 2:
        return {"kind": "linear", "x": args[0], "bias": None, "transposed": True}
    if target in CONV and args[1] is weight:
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


def linear_input(user: fx.Node, weight: fx.Node) -> fx.Node | None:
    """``x`` where ``user`` is ``linear(x, weight)`` with no bias, else None."""
    if user.op != "call_function" or user.target not in _LINEAR or len(user.args) < 2 or user.args[1] is not weight:
        return None
    bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
    return user.args[0] if bias is None else None


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
