"""Mask each LoRA adapter's update by its base layer's N:M mask, so that merging keeps the pattern.

A Hugging Face ``peft`` LoRA layer computes ``base(x) + B(A(dropout(x))) * scaling``: the update ``B A`` is
dense, so a plain merge (``W + scaling * B A``) makes an N:M weight dense again. For an annotated base weight
(``<layer>.base_layer.weight``) with adapters ``<layer>.lora_A.<name>.weight`` / ``<layer>.lora_B.<name>.weight``,
this pass rewrites each adapter's product to the masked update it stands for::

    linear(linear(u, A), B)  ->  linear(u, (B @ A) * mask)      mask = (w_nm != 0), w_nm the recipe's weight

(``mask`` transposed for a weight stored ``[in, out]``), so training moves only the kept positions and
:func:`nmcompile.deploy.merge_adapters` merges ``W + scaling * mask * (B A)``: the merged model computes what the
trained one did. The mask carries no gradient; ``A`` and ``B`` get the masked update's. An adapter weight that is
itself declared N:M is refused by name (declarations leave adapters dense by default).
"""

from __future__ import annotations

import re

import torch
from torch import fx

from .context import PassContext
from .matching import sources
from .matching.gemm_uses import linear_input

_ADAPTER = re.compile(r"^(?P<layer>.*)\.lora_(?P<side>[AB])\.(?P<name>[^.]+)\.weight$")


def mask_adapter_updates(gm: fx.GraphModule, ctx: PassContext) -> int:
    adapters: dict[tuple[str, str], dict[str, fx.Node]] = {}
    for node in gm.graph.find_nodes(op="placeholder"):  # by name: a parameter's example is not needed
        source = getattr(node.meta.get("grapharg"), "source", None)
        found = None if source is None else _ADAPTER.match(sources.parameter_fqn(source))
        if found:
            adapters.setdefault((found["layer"], found["name"]), {})[found["side"]] = node
    if not adapters:
        return 0
    declared = {t.fqn for t in ctx.targets}
    for (layer, name), sides in adapters.items():
        for side, node in sides.items():
            if f"{layer}.lora_{side}.{name}.weight" in declared:
                raise ValueError(f"{layer}.lora_{side}.{name}.weight is a LoRA adapter weight declared N:M; adapters "
                                 "stay dense (their update is masked by the layer's mask instead): exclude them "
                                 "(exclude=['*lora_*']) or drop the rule that names them")
    targets = {t.fqn: t for t in ctx.targets}
    rewritten = 0
    for (layer, _), sides in adapters.items():
        target = targets.get(f"{layer}.base_layer.weight")
        if target is None or set(sides) != {"A", "B"} or target.fqn not in ctx.projected:
            continue
        projected = ctx.projected[target.fqn][0]
        a, b = sides["A"], sides["B"]
        before = rewritten
        for first in list(a.users):
            u = linear_input(first, a)
            if u is None:
                continue
            for second in [s for s in list(first.users) if linear_input(s, b) is first]:
                _rewrite(gm.graph, second, u, a, b, projected, target.dim in (0, -2))
                rewritten += 1
            if not first.users:
                gm.graph.erase_node(first)
        if rewritten == before and (a.users or b.users):  # the update would train dense, and merge unlike it
            raise ValueError(f"{layer}: its LoRA adapters are used otherwise than linear(linear(x, A), B) (a peft "
                             "variant nmcompile does not know: DoRA, a bias, ...), so their update cannot be masked by "
                             "the base weight's N:M mask; use plain LoRA, or leave this layer's base weight undeclared")
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _rewrite(graph: fx.Graph, second: fx.Node, u: fx.Node, a: fx.Node, b: fx.Node, projected: fx.Node,
             transposed: bool) -> None:
    """``second`` (``linear(linear(u, a), b)``) -> ``linear(u, (b @ a) * mask)``."""
    with graph.inserting_before(second):
        made = [graph.call_function(torch.ne, (projected, 0))]
        if transposed:
            made.append(graph.call_function(torch.t, (made[-1],)))
        made.append(graph.call_function(torch.mm, (b, a)))
        made.append(graph.call_function(torch.mul, (made[-1], made[-2])))
        new = graph.call_function(torch._C._nn.linear, (u, made[-1]))
    value, low, high = (n.meta.get("example_value") for n in (projected, a, b))
    if value is not None and low is not None and high is not None:
        with value.fake_mode:
            shape = (high.shape[0], low.shape[1])
            values = [torch.empty(value.shape, dtype=torch.bool)] + ([torch.empty(shape, dtype=torch.bool)] if transposed
                                                                    else [])
            values += [torch.empty(shape, dtype=high.dtype)] * 2
        for node, example in zip(made, values):
            node.meta["example_value"] = example
    new.meta.update(second.meta)
    second.replace_all_uses_with(new)
    graph.erase_node(second)
