"""Calibration routes: which rows of which operand reach a declared weight's GEMMs, for
``nmsparse::accumulate_stats`` (read by :mod:`.find_nm_weights` and :mod:`.insert_calibration_stats`)."""

from __future__ import annotations

import operator

from torch import fx

from .gemm_uses import (
    GROUPED_MM, GROUPED_MM_OPS, MATMUL, batched_gemm_dim, is_gemm_like, target_name, op_name, swaps_matrix_axes,
    node_value, checkpoint_inputs, gemm_operands,
)

__all__ = ["calibration_routes"]


def calibration_routes(weight: fx.Node, dim: int) -> list[dict] | str:
    """How each GEMM/conv that reads ``weight`` (grouped along ``dim``; negative: stacked experts) gets its input: ``[{"gemm", "x", "layout", "expert",
    "route", "conv"}]`` (see :func:`nmcompile.masks.calibration.input_rows`), or why a use's input
    cannot be read (the weight is then named, not calibrated on part of its inputs)."""
    routes: list[dict] = []
    for user in list(weight.users):
        if checkpoint_inputs(user, weight) is not None:
            return ("used inside torch.utils.checkpoint, whose inputs nmcompile does not calibrate through; "
                    "calibrate without activation checkpointing (model.gradient_checkpointing_disable())")
        found = _stacked_routes(user, weight, None, None) if dim < 0 else _plain_route(user, weight)
        if isinstance(found, str):
            return found
        routes.extend(found)
    return routes


def _route(gemm, x, layout, expert=-1, route=None, conv=()) -> dict:
    return {"gemm": gemm, "x": x, "layout": layout, "expert": expert, "route": route, "conv": list(conv)}


def _plain_route(user: fx.Node, weight: fx.Node) -> list[dict] | str:
    ops = gemm_operands(user, weight)
    if ops is not None and ops["kind"] == "linear":
        return [_route(user, ops["x"], "rows")]
    if ops is not None:
        if ops["groups"] != 1:
            return f"a grouped convolution ({user.format_node()}), whose inputs nmcompile does not calibrate"
        kernel = list(weight.meta["example_value"].shape[2:])
        return [_route(user, ops["x"], "conv", conv=kernel + ops["stride"] + ops["padding"] + ops["dilation"])]
    if user.op == "call_function" and user.target in MATMUL and len(user.args) == 2 and user.args[0] is weight:
        return [_route(user, user.args[1], "t")]
    return f"its input in {user.format_node()} is not one nmcompile reads for calibration"


def _stacked_routes(user: fx.Node, operand: fx.Node, expert: int | None, ids) -> list[dict] | str:
    """Routes of a stacked weight (or an expert view of it) through views to its GEMMs."""
    if batched_gemm_dim(user, operand) is not None:
        right = user.args[1] is operand
        x = user.args[0] if right else user.args[1]
        grouped = user.target in GROUPED_MM or op_name(user.target) in GROUPED_MM_OPS
        if grouped:
            offs = user.kwargs.get("offs", user.args[2] if len(user.args) > 2 else None)
            if not right or expert is not None or ids is not None or not isinstance(offs, fx.Node):
                return f"a grouped GEMM of an expert view ({user.format_node()}) nmcompile does not calibrate"
            return [_route(user, x, "grouped", route=offs)]
        if expert is not None:
            return [_route(user, x, "rows" if right else "t", expert=expert)]
        if ids is not None:
            return [_route(user, x, "gathered" if right else "gathered_t", route=ids)]
        return [_route(user, x, "batched" if right else "batched_t")]
    if is_gemm_like(user):
        return f"its input in {user.format_node()} is not one nmcompile reads for calibration"
    if swaps_matrix_axes(user, operand) is None:
        return f"used by {user.format_node()}"
    target, args = user.target, user.args
    name = target if user.op == "call_method" else target_name(target)
    if name == "select":
        if not isinstance(args[2], int):
            return f"an expert index nmcompile does not read ({user.format_node()})"
        expert = args[2]
    elif user.op == "call_function" and target is operator.getitem:
        index = args[1][0] if isinstance(args[1], tuple) and len(args[1]) == 1 else args[1]
        if isinstance(index, int):
            expert = index
        elif isinstance(index, fx.Node):
            ids = index
        else:
            return f"an expert index nmcompile does not read ({user.format_node()})"
    if isinstance(expert, int) and expert < 0:
        expert += node_value(operand).shape[0]
    found: list[dict] = []
    for use in list(user.users):
        more = _stacked_routes(use, user, expert, ids)
        if isinstance(more, str):
            return more
        found.extend(more)
    return found
