"""Give each target's linear GEMMs 2:4 kernels where its recipe makes their operands 2:4.

    linear(x, w_nm, b), addmm(b, x, w_nm), x @ w_nm, nmsparse::linear(x, w_nm, w_dgrad, b, ...)
      ->  nmsparse::sparse_train_linear(x, w, w_dgrad, b, scale, gate, perm, mvue_n, mvue_m, fp8,
                                        forward, dgrad, wgrad, fqn)

Per weight, :func:`nmcompile.kernels.dispatch.train.decide` picks each GEMM's kernel from the
``train_kernel`` option, what the recipe declares (``forward_pattern``, ``forward_gate``,
``dgrad_pattern``, ``dgrad_order``, its MVUE pattern), the shapes and dtype in the graph, and under
``auto`` on CUDA a timing (:func:`~nmcompile.kernels.dispatch.train.measure`); the decision goes to
``ctx.train_kernels``. Never reads weight values. A GEMM whose three kernels are dense is left as
the previous passes wrote it. With a sparse forward, S-STE's ``beta`` scales the GEMM outputs
(``Recipe.forward_factors``) and its ``beta * S(W)`` is no longer built. Convolutions, stacked
(expert) weights, ``nn.MultiheadAttention``'s fused call and GEMMs inside ``torch.utils.checkpoint``
stay dense, with the reason recorded. Runs last, after :mod:`.rewrite_nm_consumers` (whose
``nmsparse::linear`` it replaces) and :mod:`.save_dgrad_weights`.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import fx
from torch.fx.proxy import GraphAppendingTracer

from ..kernels import train_gemms as training  # noqa: F401  (registers nmsparse::sparse_train_linear)
from ..kernels.dispatch.train import ROLES, TrainKernels, all_dense, decide, measure
from ..pattern import is_stacked
from .matching import gemm_uses
from .context import PassContext

log = logging.getLogger("nmcompile")

_NM_LINEAR = torch.ops.nmsparse.linear.default
_CONVS = (torch.ops.nmsparse.conv.default, *gemm_uses.CONV)
_OP = torch.ops.nmsparse.sparse_train_linear.default
_GATED_OP = torch.ops.nmsparse.sparse_train_linear_gated.default  # STEP: reads its gate on the host


def _uses(weight: fx.Node) -> tuple[list[tuple[fx.Node, dict]], str | None]:
    """The linear GEMMs that read ``weight`` (``{x, bias, transposed}``), or why it stays dense."""
    gemms = []
    for user in list(weight.users):
        if user.op == "call_method" and user.target == "detach":
            continue  # Bi-Mask's DGRAD weight is computed from it
        if user.target is torch.t and user.users and all(u.target is _NM_LINEAR and u.args[1] is user for u in user.users):
            gemms.extend((u, {"x": u.args[0], "bias": u.args[3], "transposed": True}) for u in user.users)
            continue
        if user.target is _NM_LINEAR and user.args[1] is weight:
            gemms.append((user, {"x": user.args[0], "bias": user.args[3], "transposed": False}))
            continue
        if user.target in _CONVS:
            return [], "a convolution: the 2:4 training kernels cover linear GEMMs; its GEMMs stay dense"
        if gemm_uses.checkpoint_inputs(user, weight) is not None:
            return [], "used inside torch.utils.checkpoint; its GEMMs stay dense"
        ops = gemm_uses.gemm_operands(user, weight)
        if ops is None or ops["kind"] != "linear":
            return [], f"also used by {user.format_node()}, which the training kernels do not take; dense"
        gemms.append((user, ops))
    return gemms, None


def _tokens(x) -> int | None:
    value = gemm_uses.node_value(x)
    if value is None or not all(isinstance(s, int) for s in value.shape[:-1]):
        return None  # dynamic
    return math.prod(value.shape[:-1])


def _not_24(recipe, frame, needs_dgrad: bool) -> dict[str, str | None]:
    """Per GEMM, why the recipe does not make its operand 2:4 (None where it does)."""
    forward = recipe.forward_pattern(frame)
    reasons: dict[str, str | None] = {
        "forward": None if forward == (2, 4) else (
            f"{recipe}: the forward weight is not N:M by construction" if forward is None
            else f"{recipe}: the forward weight is {forward[0]}:{forward[1]}, not 2:4"
        ),
        "dgrad": None if recipe.dgrad_pattern() == (2, 4) else (
            f"{recipe}: the input gradient's weight is not 2:4 along 'out' (transposable and bi_mask 2:4 make it so)"
        ),
        "wgrad": None if recipe.mvue == (2, 4) else (
            f"{recipe}: the weight gradient's dY is {'dense' if recipe.mvue is None else '%d:%d' % recipe.mvue} "
            "along the tokens (wgrad=mvue24 makes it 2:4)"
        ),
    }
    if not needs_dgrad:
        reasons["dgrad"] = "no input gradient is computed (the layer's input needs no gradient)"
    return reasons


def _decide(ctx: PassContext, target, gemms, timed: dict) -> TrainKernels:
    """The weight's kernels; ``timed`` keeps the timings of this graph by shape (repeated layers are timed once)."""
    value = target.node.meta["example_value"]
    out_f, in_f = value.shape if target.dim == 1 else tuple(reversed(value.shape))  # [in, out] when transposed
    tokens = {_tokens(o["x"]) for _, o in gemms}
    t = tokens.pop() if len(tokens) == 1 else None
    outputs = [gemm_uses.node_value(node) for node, _ in gemms]
    dtype = next((v.dtype for v in outputs if v is not None), value.dtype)  # autocast: the GEMM's dtype
    needs_dgrad = any(getattr(gemm_uses.node_value(o["x"]), "requires_grad", False) for _, o in gemms)
    not_24 = _not_24(target.recipe, target.frame, needs_dgrad)
    shapes = {"forward": (out_f, in_f, t), "dgrad": (in_f, out_f, t), "wgrad": (out_f, t, in_f)}
    # the weight's GPU, not the current one (None: the current device's, as the rules read it)
    capability = torch.cuda.get_device_capability(value.device) if value.device.type == "cuda" else None
    decisions = {}
    for role in ROLES:
        rows, cols, n = shapes[role]
        decision = decide(
            ctx.train_kernel, role, layer=target.fqn, not_24=not_24[role], rows=rows, cols=cols, n=n,
            dtype=dtype, device_type=value.device.type, capability=capability,
        )
        if ctx.train_kernel == "auto" and decision.kernel in ("cusparselt", "cutlass"):
            permuted = role == "dgrad" and target.recipe.dgrad_order(*ctx.state_nodes[target.fqn]) is not None
            key = (decision, role, rows, cols, n, dtype, str(value.device), permuted)
            if key not in timed:
                timed[key] = measure(decision, role, rows=rows, cols=cols, n=n, dtype=dtype, device=value.device,
                                     permuted=permuted, graphs=ctx.cuda_graphs)
            decision = timed[key]
        decisions[role] = decision
    return TrainKernels(**decisions)


def _fake_meta(graph: fx.Graph, before: set, fake_mode) -> None:
    """``example_value`` for the nodes added since ``before`` (calls on fake tensors)."""
    for node in graph.nodes:
        if node in before or "example_value" in node.meta:
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["example_value"])
        with fake_mode:
            node.meta["example_value"] = node.target(*args, **kwargs)


def _transposed(graph: fx.Graph, node: fx.Node, cache: dict) -> fx.Node:
    if node not in cache:
        existing = [u for u in node.users if u.target is torch.t]
        if existing:
            cache[node] = existing[0]
        else:
            with graph.inserting_after(node):
                cache[node] = graph.call_function(torch.t, (node,))
            cache[node].meta["example_value"] = node.meta["example_value"].t()
    return cache[node]


def _rewrite(gm: fx.GraphModule, ctx: PassContext, target, gemms, kernels: TrainKernels) -> int:
    graph = gm.graph
    recipe = target.recipe
    weight, dgrad, _ = ctx.projected[target.fqn]
    fake_mode = target.node.meta["example_value"].fake_mode
    tracer = GraphAppendingTracer(graph)
    state = [fx.Proxy(n, tracer) for n in ctx.state_nodes[target.fqn]]
    before = set(graph.nodes)
    operand, scale, gate, perm = weight, None, None, None
    with graph.inserting_before(weight.next):
        if kernels.forward.sparse:
            factors = recipe.forward_factors(fx.Proxy(target.node, tracer), *state, dim=target.dim, frame=target.frame)
            if factors is not None:
                operand, scale = factors[0].node, factors[1].node
            gate = recipe.forward_gate(*state)
        if kernels.dgrad.sparse:
            perm = recipe.dgrad_order(*state)
    _fake_meta(graph, before, fake_mode)
    gate, perm = (None if p is None else p.node for p in (gate, perm))
    w_dgrad = operand if scale is not None or dgrad is None else dgrad
    mvue_n, mvue_m = recipe.mvue or (0, 0)
    kinds = tuple(getattr(kernels, role).kernel for role in ROLES)
    cache: dict = {}
    for user, ops in gemms:
        w, wd = operand, w_dgrad
        if ops["transposed"]:
            w, wd = _transposed(graph, operand, cache), _transposed(graph, w_dgrad, cache)
        args = (ops["x"], w, wd, ops["bias"], scale, gate, perm, mvue_n, mvue_m,
                bool(getattr(recipe, "fp8", False)), *kinds, target.fqn)
        gemm_uses.replace_call(user, _OP if gate is None else _GATED_OP, args)
    for node in (*[u for u in weight.users if u.target is torch.t], weight):  # S-STE's beta * S(W), if unused now
        if not node.users and node.op == "call_function":
            graph.erase_node(node)
    return len(gemms)


def rewrite_sparse_training_gemms(gm: fx.GraphModule, ctx: PassContext) -> int:
    rewritten = 0
    timed: dict = {}
    for target in ctx.targets:
        weight = ctx.projected[target.fqn][0]
        if is_stacked(target.node.meta["example_value"].dim(), target.dim):
            gemms, why = [], "a stacked (expert) weight: its per-expert GEMMs stay dense"
        else:
            gemms, why = _uses(weight)
            if why is None and target.node.meta["example_value"].dim() != 2:
                why = "not a 2-D weight; the training kernels take linear weights"
        if why is not None or not gemms:
            ctx.train_kernels[target.fqn] = all_dense(why or "no linear GEMM uses it in this graph")
            continue
        kernels = ctx.train_kernels[target.fqn] = _decide(ctx, target, gemms, timed)
        log.info("nmsparse training GEMMs: %s -> %s", target.fqn, kernels)
        if kernels.sparse:
            rewritten += _rewrite(gm, ctx, target, gemms, kernels)
    gm.graph.lint()
    gm.recompile()
    return rewritten
