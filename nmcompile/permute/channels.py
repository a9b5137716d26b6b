"""Permute channels between layers so that one-shot N:M pruning keeps more magnitude.

N:M groups run along a weight's input channels (dim 1 of a Linear or Conv weight). Those
channels are produced by an earlier layer, so reordering the producer's output channels (weight
rows and bias), every per-channel op in between (BatchNorm's affine parameters and running
statistics) and the consumer's input channels in the same way leaves the model's function
unchanged, while choosing which channels share an N:M group. The order comes from
:func:`nmcompile.masks.permutation.search_permutation`.

:func:`permute_channels` finds each producer with ``torch.fx.symbolic_trace``: from the listed
consumer it walks back through element-wise activations, dropout, identity and BatchNorm to an
``nn.Linear``/``nn.Conv1d``/``nn.Conv2d`` (``groups=1``). It then follows everything the producer's
output flows into; all of it must be one of those pass-through ops or a listed consumer, or the
permutation would change the model's output, and the group is skipped with a reason. Consumers
fed by one producer share one permutation, searched on their weights stacked together.

The trace does not show everything that could see the moved channels, so a group is also skipped
when :mod:`nmcompile.permute.checks` finds one: module hooks (global, on a layer of the group, on
a container the permuted tensor leaves), parametrizations, gradient hooks, another name or view
of a moved tensor's memory (tied weights), or a read of a moved tensor outside its layer's call
(``F.linear(x, self.fc1.weight)``). Each permuted group is then checked numerically by
:mod:`nmcompile.permute.proof` (the whole model on example or derived inputs, else the group's
own layers); a group that fails is put back bit for bit and skipped with the reason.

Use it before one-shot magnitude pruning (e.g. the ASP recipe) and before annotating: weights
that already carry an nmcompile recipe are left alone, as their recipe state would go stale. It
changes parameter values in place (``copy_``), never the Parameter objects, so references held
elsewhere and attributes set on parameters stay valid; an optimizer's per-element state (e.g.
momentum) is not permuted, so create the optimizer afterwards. With BatchNorm on the path,
outputs match in eval mode (in training mode the batch statistics are per channel too, so they
match as well up to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn

from ..state import records
from ..masks.permutation import kept_magnitude, search_permutation
from ..pattern import is_stacked, reduction_dim
from .graph import BATCHNORMS, PRODUCERS, Skip, closure, find_producer
from .checks import (boundary_hooks, global_hooks, graph_reads, module_hooks, other_owners,
                             read_elsewhere, tensor_hooks, tensor_owners)
from .proof import ModelProbe, Unchecked, derive_inputs, mismatch, run_group

__all__ = ["permute_channels", "PermutationReport", "PermutationGroup"]

@dataclass
class PermutationGroup:
    """One permutation: the consumers sharing it, their producer and the BatchNorms between."""

    consumers: list[str]
    producer: str
    batchnorms: list[str]
    kept_before: float
    kept_after: float

    @property
    def gain(self) -> float:
        """Relative increase of the consumers' kept magnitude (0.0 when nothing was kept)."""
        return (self.kept_after - self.kept_before) / self.kept_before if self.kept_before else 0.0


@dataclass
class PermutationReport:
    """What :func:`permute_channels` permuted (``groups``) and what it left alone (``skipped``)."""

    groups: list[PermutationGroup] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    n: int | None = None
    m: int | None = None
    checked: str | None = None  # how the permuted groups were checked numerically

    @property
    def total_gain(self) -> float:
        """Relative increase of the kept magnitude summed over all groups' consumers."""
        before = sum(g.kept_before for g in self.groups)
        after = sum(g.kept_after for g in self.groups)
        return (after - before) / before if before else 0.0

    def __str__(self) -> str:
        head = ("consumers", "producer", "kept before", "kept after", "gain")
        rows = [
            (", ".join(g.consumers), g.producer + "".join(f" > {b}" for b in g.batchnorms),
             f"{g.kept_before:.4g}", f"{g.kept_after:.4g}", f"{100 * g.gain:+.2f}%")
            for g in self.groups
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        pattern = f" for {self.n}:{self.m}" if self.n is not None else ""
        lines = [f"channel permutation{pattern}: {len(self.groups)} group(s), "
                 f"total gain {100 * self.total_gain:+.2f}%"]
        if self.checked and self.groups:
            lines.append(f"function checked on {self.checked}")
        if rows:
            for r in [head, *rows]:
                cells = (c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                lines.append("  ".join(cells).rstrip())
        if self.skipped:
            lines.append("skipped:")
            lines += [f"  {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _as_columns(w: torch.Tensor) -> torch.Tensor:
    """(rows, in_channels) view of a Linear/Conv weight: columns are input channels."""
    return w.detach().movedim(1, -1).reshape(-1, w.shape[1])


def permute_channels(model: nn.Module, names, n: int, m: int, *, seed: int = 0,
                     example_inputs=None) -> PermutationReport:
    """Permute the input channels of the weights ``names`` (and their producers' output channels)
    so that top-n of m along dim 1 keeps more magnitude, without changing ``model``'s function.

    ``names`` are parameter names such as ``"fc2.weight"`` of ``nn.Linear``, ``nn.Conv1d`` or
    ``nn.Conv2d`` (``groups=1``) modules called once in the model. Parameters and buffers change
    in place; names that cannot be permuted safely are listed in the report's ``skipped``.

    Each permuted group is checked numerically: the whole model on ``example_inputs`` (a tensor
    or a tuple of positional arguments) or, without them, on inputs derived from the layers the
    model's inputs enter; where none can be derived, the group's own layers on an input for its
    producer. A group whose check fails is put back exactly as it was and listed in ``skipped``.
    """
    report = PermutationReport(n=n, m=m)
    wanted: dict[str, str] = {}  # module name -> parameter name
    modules = dict(model.named_modules())
    for name in dict.fromkeys(names):
        mod_name, _, attr = name.rpartition(".")
        mod = modules.get(mod_name)
        param = getattr(mod, attr, None) if mod is not None else None
        dim = reduction_dim(mod, attr, param) if isinstance(param, nn.Parameter) else None
        if dim is not None and is_stacked(param.dim(), dim):
            report.skipped[name] = (f"{type(mod).__name__}.{attr} is a stacked (expert) weight; channel permutation "
                                    "is implemented for nn.Linear, nn.Conv1d and nn.Conv2d (its N:M mask still applies)")
        elif mod is None or attr != "weight" or not isinstance(getattr(mod, "weight", None), nn.Parameter):
            report.skipped[name] = "not the weight (an nn.Parameter) of a module of the model"
        elif not isinstance(mod, PRODUCERS):
            report.skipped[name] = f"{type(mod).__name__} is not an nn.Linear, nn.Conv1d or nn.Conv2d"
        elif getattr(mod, "groups", 1) != 1:
            report.skipped[name] = f"grouped convolution (groups={mod.groups})"
        else:
            wanted[mod_name] = name
    if not wanted:
        return report

    reason = global_hooks()
    if reason is None:
        try:
            gm = torch.fx.symbolic_trace(model)
        except Exception as exc:  # noqa: BLE001 - any tracing failure means: leave the model alone
            first = (str(exc).strip().splitlines() or [""])[0]
            reason = f"torch.fx tracing failed: {type(exc).__name__}: {first}"
    if reason is not None:
        for name in wanted.values():
            report.skipped[name] = reason
        return _ordered(report, names)
    graph = gm.graph

    calls: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls.setdefault(node.target, []).append(node)

    consumers: dict[str, torch.fx.Node] = {}
    for mod_name, name in wanted.items():
        sites = calls.get(mod_name, [])
        if len(sites) != 1:
            report.skipped[name] = ("not called in the traced model" if not sites
                                    else f"called {len(sites)} times in the traced model")
        else:
            consumers[mod_name] = sites[0]

    probe = _model_probe(model, graph, modules, example_inputs, seed)
    report.checked = probe.source if probe is not None else "each group's layers on an input for its producer"
    reference = probe() if probe is not None else None
    facts = _Facts(modules, calls, tensor_owners(model), graph_reads(gm), m, given_inputs=example_inputs is not None)

    done: set[str] = set()
    for mod_name, node in consumers.items():
        if mod_name in done:
            continue
        try:
            producer = find_producer(node, modules)
            group, path = closure(producer, consumers, wanted, modules, calls)
        except Skip as why:
            report.skipped[wanted[mod_name]] = str(why)
            done.add(mod_name)
            continue
        done.update(group)
        group_names = [wanted[c] for c in group]
        try:
            _check_group(producer, group, path, facts)
            result = _permute_checked(model, modules, producer, [consumers[c] for c in group], group_names,
                                      path, n, m, seed, probe, reference)
        except Skip as why:
            for name in group_names:
                report.skipped[name] = str(why)
            continue
        if result is not None:
            report.groups.append(result)
    return _ordered(report, names)


def _ordered(report: PermutationReport, names) -> PermutationReport:
    """The skipped dict in the order the names were given."""
    order = list(dict.fromkeys(names))
    report.skipped = {k: report.skipped[k] for k in order if k in report.skipped}
    return report


def _model_probe(model, graph, modules, example_inputs, seed) -> ModelProbe | None:
    if example_inputs is not None:
        probe = ModelProbe(model, example_inputs, "the whole model on example_inputs", seed)
        try:
            probe()
        except Exception as exc:
            raise ValueError(f"permute_channels: the model failed on example_inputs ({type(exc).__name__}: "
                             f"{exc}); pass the positional arguments of its forward as a tuple") from exc
        return probe
    inputs = derive_inputs(graph, modules, seed)
    if inputs is None:
        return None
    shapes = ", ".join(str(tuple(x.shape)) for x in inputs)
    probe = ModelProbe(model, inputs, f"the whole model on derived inputs of shape {shapes}", seed)
    try:
        probe()
    except Exception:  # noqa: BLE001 - a guessed input that does not fit: check each group on its own
        return None
    return probe


@dataclass
class _Facts:
    """What every group's structural check reads: the model's modules and call sites, every name
    of its tensors, the tensors its forward reads outside module calls."""

    modules: dict[str, nn.Module]
    calls: dict[str, list[torch.fx.Node]]
    owners: list
    reads: list
    m: int
    given_inputs: bool


def _check_group(producer, group, path, facts: _Facts):
    modules, calls = facts.modules, facts.calls
    prod = modules[producer.target]
    if len(calls[producer.target]) != 1:
        raise Skip(f"its producer '{producer.target}' is called more than once")
    channels = prod.weight.shape[0]
    for c in group:
        if modules[c].weight.shape[1] != channels:
            raise Skip(f"'{c}' takes {modules[c].weight.shape[1]} channels but '{producer.target}' "
                        f"makes {channels}")
    for node in path:
        if node.op == "call_module" and isinstance(modules[node.target], BATCHNORMS):
            if len(calls[node.target]) != 1:
                raise Skip(f"BatchNorm '{node.target}' on the path is called more than once")
            if modules[node.target].num_features != channels:
                raise Skip(f"BatchNorm '{node.target}' has {modules[node.target].num_features} "
                            f"features, not {channels}")
            if isinstance(prod, nn.Linear) and not facts.given_inputs:
                raise Skip(f"BatchNorm1d '{node.target}' normalizes dim 1, which is the features of "
                            f"'{producer.target}' (a Linear) only for 2-D inputs; pass example_inputs to "
                            "permute_channels to check it")
    if channels % facts.m:
        raise Skip(f"{channels} channels are not a multiple of m={facts.m}")
    chain = [producer.target, *(p.target for p in path if p.op == "call_module"), *group]
    for mod_name in chain:
        reason = module_hooks(mod_name, modules[mod_name])
        if reason is not None:
            raise Skip(reason)
    reason = boundary_hooks(chain, modules)
    if reason is not None:
        raise Skip(reason)
    for mod_name, tensor_name, t in _moved(modules, producer.target, group, path):
        name = f"{mod_name}.{tensor_name}"
        others = other_owners(name, t, facts.owners)
        if others:
            raise Skip(f"'{name}' shares its memory with {', '.join(others)}; permuting it would change them too")
        reason = tensor_hooks(name, t) or read_elsewhere(name, t, facts.reads)
        if reason is not None:
            raise Skip(reason)
    for mod_name in chain:
        for pname, t in [*modules[mod_name].named_parameters(recurse=False),
                         *modules[mod_name].named_buffers(recurse=False)]:
            if records.get(modules[mod_name], records.RECIPES, pname) is not None:
                raise Skip(f"'{mod_name}.{pname}' already carries an nmcompile recipe whose state "
                            "would no longer match; permute before annotating")


def _moved(modules, producer: str, group, path) -> list[tuple[str, str, torch.Tensor]]:
    """(module, tensor name, tensor) of everything the permutation rewrites."""
    out = [(producer, "weight", modules[producer].weight)]
    if modules[producer].bias is not None:
        out.append((producer, "bias", modules[producer].bias))
    for p in path:
        if p.op == "call_module" and isinstance(modules[p.target], BATCHNORMS):
            bn = modules[p.target]
            for t in ("weight", "bias", "running_mean", "running_var"):
                if getattr(bn, t) is not None:
                    out.append((p.target, t, getattr(bn, t)))
    out += [(c, "weight", modules[c].weight) for c in group]
    return out


def _permute_checked(model, modules, producer, consumer_nodes, group_names, path, n, m, seed, probe, reference):
    """Permute one group, check the function, and put everything back if the check fails."""
    group = [c.target for c in consumer_nodes]
    if probe is None:
        try:
            reference = run_group(model, modules, producer, path, consumer_nodes, seed)
        except Unchecked as why:
            raise Skip(f"it cannot be checked numerically ({why}); pass example_inputs to "
                        "permute_channels") from None
    saved = [(t, t.detach().clone()) for *_, t in _moved(modules, producer.target, group, path)]
    result = _permute_group(modules, producer.target, group, group_names, path, n, m, seed)
    try:
        after = probe() if probe is not None else run_group(model, modules, producer, path, consumer_nodes, seed)
        why = mismatch(reference, after)
    except Exception as exc:  # noqa: BLE001 - a forward that fails after permuting: undo, name it
        why = f"the forward failed: {type(exc).__name__}: {exc}"
    if why is None:
        return result
    with torch.no_grad():
        for t, old in saved:
            t.copy_(old)
    where = probe.source if probe is not None else "the group's layers on an input for its producer"
    raise Skip(f"permuting '{producer.target}' > {', '.join(group)} changed {where}: {why}; "
                "left unpermuted (something reads these channels in an order the trace does not show)")


def _permute_group(modules, producer: str, group, group_names, path, n, m, seed) -> PermutationGroup:
    matrix = torch.cat([_as_columns(modules[c].weight).float().cpu() for c in group])
    before = kept_magnitude(matrix, n, m)
    perm = search_permutation(matrix, n, m, seed=seed)
    after = kept_magnitude(matrix[:, perm], n, m)
    bns = [p.target for p in path if p.op == "call_module" and isinstance(modules[p.target], BATCHNORMS)]
    if not torch.equal(perm, torch.arange(perm.numel())):
        with torch.no_grad():
            for mod_name, _, t in _moved(modules, producer, group, path):
                _permute_(t, perm, 1 if mod_name in group else 0)
    return PermutationGroup(consumers=list(group_names), producer=producer, batchnorms=bns,
                            kept_before=before, kept_after=after)


def _permute_(t: torch.Tensor, perm: torch.Tensor, dim: int) -> None:
    t.copy_(t.index_select(dim, perm.to(t.device)))
