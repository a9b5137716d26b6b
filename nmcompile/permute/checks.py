"""Reasons not to permute channels that a ``torch.fx`` graph of the model does not show.

:func:`nmcompile.permute.channels.permute_channels` reads the model's structure from
``torch.fx.symbolic_trace``, which records module calls but not the hooks they run, and records
a parameter read outside its module's call as a ``get_attr`` node that nothing else looks at.
These functions name what would see the permuted channels in such places: module hooks (global,
on a layer of the group, or on a module whose boundary the permuted tensor crosses),
parametrizations, gradient hooks on the moved tensors, other names or views of the moved tensors'
memory, and reads of them elsewhere in the traced forward. Each returns a reason or None.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn
from torch.nn.modules import module as _module
from torch.nn.utils import parametrize

__all__ = ["global_hooks", "module_hooks", "boundary_hooks", "tensor_hooks", "memory_of", "tensor_owners",
           "other_owners", "graph_reads", "read_elsewhere"]

_FIX = "remove it while annotating, or annotate with permute=false"
_HOOKS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)
# reads of a tensor that do not depend on the order of its elements
_METADATA_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad"}
_METADATA_METHODS = {"size", "dim", "numel", "type"}


def _names(hooks) -> str:
    return ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks)


def global_hooks() -> str | None:
    """Module hooks registered for every module (``register_module_forward_hook`` and the like)."""
    for kind in ("forward pre-hook", "forward hook", "backward pre-hook", "backward hook"):
        hooks = getattr(_module, "_global_" + kind.replace(" ", "_").replace("-", "_") + "s", None)
        if hooks:
            return (f"a global module {kind} is registered ({_names(hooks.values())}) and would see permuted "
                    f"channels; {_FIX}")
    return None


def module_hooks(name: str, module: nn.Module) -> str | None:
    """Hooks or parametrizations on a module of the group (its inputs, outputs or weights move)."""
    for attr, kind in _HOOKS:
        hooks = getattr(module, attr, None)
        if hooks:
            return f"'{name}' has a {kind} ({_names(hooks.values())}) that would see permuted channels; {_FIX}"
    if parametrize.is_parametrized(module):
        return (f"'{name}' has a parametrization of {', '.join(module.parametrizations)}, whose "
                "original tensors are not what the permutation moves; annotate with permute=false")
    return None


def boundary_hooks(chain: list[str], modules: dict[str, nn.Module]) -> str | None:
    """Hooks on a module that holds some layers of the group but not all: the permuted tensor
    crosses its boundary, so its hooks see permuted inputs or outputs."""
    for name in chain:
        parts = name.split(".")
        for i in range(1, len(parts)):
            outer = ".".join(parts[:i])
            if all(c == outer or c.startswith(outer + ".") for c in chain):
                continue
            for attr, kind in _HOOKS:
                hooks = getattr(modules[outer], attr, None)
                if hooks:
                    return (f"'{outer}', which holds '{name}' but not every layer of the group, has a {kind} "
                            f"({_names(hooks.values())}) that would see permuted channels; {_FIX}")
    return None


def tensor_hooks(name: str, t: torch.Tensor) -> str | None:
    """Gradient hooks on a tensor the permutation moves: they would see permuted gradients."""
    if getattr(t, "_backward_hooks", None) or getattr(t, "_post_accumulate_grad_hooks", None):
        return f"'{name}' has a gradient hook that would see permuted gradients; {_FIX}"
    return None


def memory_of(t: torch.Tensor):
    """``(device, storage, first byte, end byte)`` of the memory ``t`` views, or None (meta, empty,
    or a tensor subclass without plain storage)."""
    try:
        if t.device.type == "meta" or t.numel() == 0:
            return None
        storage = t.untyped_storage().data_ptr()
        size = t.element_size()
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        start = t.data_ptr() - size * sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if s < 0)
        return (t.device, storage, start, start + span * size)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _overlap(a, b) -> bool:
    return a is not None and b is not None and a[:2] == b[:2] and a[2] < b[3] and b[2] < a[3]


def tensor_owners(model: nn.Module) -> list[tuple[str, torch.Tensor, object]]:
    """Every name of every parameter and buffer (tied names repeated) with its memory."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [(n, t, memory_of(t)) for n, t in named]


def other_owners(name: str, t: torch.Tensor, owners) -> list[str]:
    """Names other than ``name`` under which ``t`` or memory it shares is reachable in the model."""
    mine = memory_of(t)
    return [n for n, u, mem in owners if n != name and (u is t or _overlap(mine, mem))]


def _attr(root, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _metadata_only(node: torch.fx.Node) -> bool:
    for user in node.users:
        if user.op == "call_function" and user.target is getattr and len(user.args) > 1:
            if user.args[1] in _METADATA_ATTRS:
                continue
        if user.op == "call_method" and user.target in _METADATA_METHODS:
            continue
        return False
    return True


def graph_reads(gm: torch.fx.GraphModule) -> list[tuple[str, object]]:
    """Tensors the traced forward reads outside module calls (``self.fc1.weight`` passed to a
    function, tensor constants): ``(description, memory)``; reads of shape or dtype only are left out."""
    reads = []
    for node in gm.graph.nodes:
        if node.op != "get_attr" or _metadata_only(node):
            continue
        t = _attr(gm, node.target)
        if isinstance(t, torch.Tensor):
            users = ", ".join(u.name for u in node.users) or "nothing"
            reads.append((f"as '{node.target}' by {users}", memory_of(t)))
    return reads


def read_elsewhere(name: str, t: torch.Tensor, reads) -> str | None:
    """Why ``t`` (named ``name``) must not move: a read of its memory outside its module's call."""
    mine = memory_of(t)
    for what, mem in reads:
        if _overlap(mine, mem):
            return (f"'{name}' is also read outside its layer's call ({what}), which would see it permuted; "
                    "permuting it would change the model's function")
    return None
