"""Numerical check that a channel permutation left a model's function unchanged.

The structural analysis of :mod:`nmcompile.permute.channels` decides what may move; this module
checks the result on fixed inputs. With the model's inputs (given, or derived from the first
layer each input of the traced forward enters), :class:`ModelProbe` runs the whole model;
otherwise :func:`run_group` runs one group's producer, the ops between and its consumers on an
input for the producer. Runs are in eval mode, without gradients, from a fixed random seed, and
leave no trace on the model: training flags, buffers (running statistics, counters) and the
global random state are restored afterwards.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["TOLERANCE", "mismatch", "ModelProbe", "derive_inputs", "run_group", "Unchecked"]

#: largest accepted |after - before| relative to max(1, max |before|), per output dtype: the
#: permutation reorders the sums of the consumers' reductions, nothing else
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


class Unchecked(Exception):
    """A group's layers cannot be run on their own (an op between them takes another traced value)."""


@contextlib.contextmanager
def quiet(model: nn.Module, seed: int):
    """Eval mode, no gradients, buffers and random state restored on exit."""
    flags = {mod: mod.training for mod in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for mod in flags:  # the flag only: a module's own train() may do more
                mod.training = False
            torch.manual_seed(seed)
            yield
    finally:
        for mod, flag in flags.items():
            mod.training = flag
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _clone(out):
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, out)


def mismatch(before, after) -> str | None:
    """Why ``after`` is not ``before`` within :data:`TOLERANCE`, or None when it is."""
    leaves_b, spec_b = tree_flatten(before)
    leaves_a, spec_a = tree_flatten(after)
    if spec_a != spec_b:
        return "the structure of the output changed"
    for i, (b, a) in enumerate(zip(leaves_b, leaves_a)):
        where = f"output {i}" if len(leaves_b) > 1 else "the output"
        if not isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) and a == b:
                continue
            return f"{where} changed"
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return f"{where} changed shape or dtype"
        if not (b.is_floating_point() or b.is_complex()):
            if not torch.equal(a, b):
                return f"{where} changed"
            continue
        if b.numel() == 0:
            continue
        both_nan = torch.isnan(a) & torch.isnan(b)
        diff = torch.where(both_nan, 0.0, (a.double() - b.double()).abs())
        scale = max(1.0, float(torch.nan_to_num(b.double()).abs().max()))
        err = float(torch.nan_to_num(diff, nan=math.inf).max())
        tol = TOLERANCE.get(b.dtype, TOLERANCE[torch.float32]) * scale
        if not err <= tol:
            return f"{where} moved by {err:.3g} (tolerance {tol:.3g})"
    return None


def _input_for(module: nn.Module, gen: torch.Generator) -> torch.Tensor | None:
    """A small input of the shape and dtype ``module`` takes, or None for other modules."""
    if isinstance(module, nn.Embedding):
        return torch.randint(0, module.num_embeddings, (2, 8), generator=gen).to(module.weight.device)
    if isinstance(module, nn.Linear):
        shape = (2, module.in_features)
    elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
        spatial = tuple(d * (k - 1) + 1 + 2 * s for k, d, s in zip(module.kernel_size, module.dilation, module.stride))
        shape = (2, module.in_channels, *spatial)
    else:
        return None
    w = module.weight
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(w.device, w.dtype)


def derive_inputs(graph: torch.fx.Graph, modules: dict[str, nn.Module], seed: int) -> tuple | None:
    """Inputs for the traced forward: each required input is sized for the layer it first enters
    (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding); None when one cannot be sized that way."""
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        if node.args:  # has a default: leave it to the forward
            break
        if str(node.target).startswith("*"):
            return None
        first = next((u for u in node.users if u.op == "call_module" and u.args and u.args[0] is node), None)
        value = _input_for(modules[first.target], gen) if first is not None else None
        if value is None:
            return None
        inputs.append(value)
    return tuple(inputs)


class ModelProbe:
    """The whole model's output on fixed inputs; ``source`` says where the inputs came from."""

    def __init__(self, model: nn.Module, inputs, source: str, seed: int):
        self.model = model
        self.inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        self.source = source
        self.seed = seed

    def __call__(self):
        with quiet(self.model, self.seed):
            return _clone(self.model(*self.inputs))


def _call(node: torch.fx.Node, modules, args, kwargs):
    if node.op == "call_module":
        return modules[node.target](*args, **kwargs)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    return getattr(args[0], node.target)(*args[1:], **kwargs)


def run_group(model: nn.Module, modules, producer: torch.fx.Node, path, consumers, seed: int):
    """The consumers' outputs when the producer gets a fixed input and the ops on ``path`` run
    in between, as in the traced forward. Raises :class:`Unchecked` when that is not possible."""
    x = _input_for(modules[producer.target], torch.Generator().manual_seed(seed))
    if x is None:
        raise Unchecked(f"no input can be made for '{producer.target}'")
    with quiet(model, seed):
        env = {producer: modules[producer.target](x)}

        def value(arg):
            if arg not in env:
                raise Unchecked(f"an op between '{producer.target}' and its consumers also takes {arg.name}")
            return env[arg]

        for node in [*path, *consumers]:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
            env[node] = _call(node, modules, args, kwargs)
        return [_clone(env[c]) for c in consumers]
