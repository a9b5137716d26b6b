"""Which layers share a channel order, read from a model's ``torch.fx`` trace.

A producer (Linear, Conv1d, Conv2d without groups) and the consumers of its output channels, with
only element-wise ops and BatchNorm between them, form one group that a channel permutation can
reorder without changing the function. Anything else on the way raises :class:`Skip` with the
reason, which :func:`nmcompile.permute.channels.permute_channels` reports. ``closure`` and
``find_producer`` walk the trace; the rest are their helpers.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = ["Skip", "PRODUCERS", "BATCHNORMS", "find_producer", "closure"]

PRODUCERS = (nn.Linear, nn.Conv1d, nn.Conv2d)
# element-wise modules: they commute with any permutation of channels
_PASS_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.ELU,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Mish,
    nn.Softplus,
    nn.Dropout,
    nn.Identity,
)
_PASS_FUNCTIONS = {
    torch.relu,
    torch.relu_,
    F.relu,
    F.relu_,
    F.relu6,
    F.gelu,
    F.silu,
    F.mish,
    F.elu,
    torch.tanh,
    F.tanh,
    torch.sigmoid,
    F.sigmoid,
    F.leaky_relu,
    F.hardtanh,
    F.hardswish,
    F.hardsigmoid,
    F.softplus,
    F.dropout,
}
_PASS_METHODS = {"relu", "relu_", "tanh", "tanh_", "sigmoid", "sigmoid_"}
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


class Skip(Exception):
    pass


def _describe(node: torch.fx.Node, modules: dict[str, nn.Module]) -> str:
    if node.op == "call_module":
        return f"{type(modules[node.target]).__name__} '{node.target}'"
    if node.op == "call_function":
        return f"{getattr(node.target, '__name__', str(node.target))} ({node.name})"
    if node.op == "call_method":
        return f".{node.target}() ({node.name})"
    if node.op == "output":
        return "the model's output"
    return f"{node.op} '{node.target}'"


def _kind(module: nn.Module) -> str:
    return type(module).__name__ if isinstance(module, (nn.Conv1d, nn.Conv2d)) else "Linear"


def _is_pass(node: torch.fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules[node.target], _PASS_MODULES)
    if node.op == "call_function":
        return node.target in _PASS_FUNCTIONS
    if node.op == "call_method":
        return node.target in _PASS_METHODS
    return False


def _only_first_arg(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """``node`` is ``user``'s first argument and appears nowhere else in its arguments."""
    if not user.args or user.args[0] is not node:
        return False
    others: list[torch.fx.Node] = []
    torch.fx.node.map_arg((user.args[1:], user.kwargs), others.append)
    return node not in others


def _supported_weight(module: nn.Module) -> bool:
    return isinstance(module, PRODUCERS) and getattr(module, "groups", 1) == 1


def find_producer(consumer: torch.fx.Node, modules) -> torch.fx.Node:
    """Walk back from the consumer's input through pass-through ops and BatchNorm."""
    kind = _kind(modules[consumer.target])
    if not consumer.args or not isinstance(consumer.args[0], torch.fx.Node):
        raise Skip("its input is not a traced tensor")
    cur = consumer.args[0]
    while True:
        if cur.op == "placeholder":
            raise Skip(f"its input channels come from the model input '{cur.target}', not a layer")
        if cur.op == "call_module":
            mod = modules[cur.target]
            if _supported_weight(mod):
                if _kind(mod) != kind:
                    raise Skip(f"its producer {_describe(cur, modules)} is a {_kind(mod)} and the "
                                f"consumer a {kind}: their channel dims differ")
                return cur
            if isinstance(mod, PRODUCERS):
                raise Skip(f"its producer {_describe(cur, modules)} is a grouped convolution")
        if not (_is_pass(cur, modules) or _is_bn(cur, modules, kind)):
            raise Skip(f"{_describe(cur, modules)} between it and its producer does not commute "
                        "with a channel permutation")
        nxt = cur.args[0] if cur.args else None
        if not isinstance(nxt, torch.fx.Node):
            raise Skip(f"{_describe(cur, modules)} has no traced tensor input")
        cur = nxt


def _is_bn(node: torch.fx.Node, modules, kind: str) -> bool:
    if node.op != "call_module" or not isinstance(modules[node.target], BATCHNORMS):
        return False
    # BatchNorm's channel dim is dim 1: the features of a 2-D Linear output, a Conv1d's channels
    # (BatchNorm1d) or a Conv2d's channels (BatchNorm2d)
    bn = modules[node.target]
    return isinstance(bn, nn.BatchNorm2d) if kind == "Conv2d" else type(bn) is nn.BatchNorm1d


def closure(producer: torch.fx.Node, consumers: dict[str, torch.fx.Node], listed, modules, calls):
    """Everything the producer's output flows into: the consumers (module names, graph order)
    and the pass-through/BatchNorm nodes; any other use raises Skip."""
    kind = _kind(modules[producer.target])
    group: list[str] = []
    path: list[torch.fx.Node] = []
    todo = [producer]
    seen = {producer}
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            where = f"the output of '{producer.target}'" + ("" if node is producer else f" (through {node.name})")
            if user.op == "call_module" and user.target in consumers and consumers[user.target] is user:
                if not _only_first_arg(user, node):
                    raise Skip(f"{where} is passed to {_describe(user, modules)} in an unexpected way")
                group.append(user.target)
                seen.add(user)
                continue
            if (_is_pass(user, modules) or _is_bn(user, modules, kind)) and _only_first_arg(user, node):
                seen.add(user)
                path.append(user)
                todo.append(user)
                continue
            extra = ""
            if user.op == "call_module" and _supported_weight(modules[user.target]):
                extra = " (called more than once)" if user.target in listed else " (not in names)"
            raise Skip(f"{where} is also used by {_describe(user, modules)}{extra}; "
                        "permuting it would change the model's function")
    order = {node: i for i, node in enumerate(producer.graph.nodes)}
    group.sort(key=lambda t: order[calls[t][0]])
    path.sort(key=order.__getitem__)
    return group, path
