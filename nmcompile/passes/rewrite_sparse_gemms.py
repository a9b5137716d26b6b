"""Rewrite each finalized 2:4 linear to a 2:4 kernel with its weight compressed once.

For every deployed weight whose decision is a sparse kernel (``[in, out]`` weights as ``W.t()``),
adds two placeholders (the compressed values and metadata; the backend passes them on every call,
compressed when the graph is compiled and again only if the weight changes) and replaces each
``F.linear(x, W, b)`` with

- ``nmsparse::cpu24_linear(x, values, bits, b, W, out_features, max_tokens, isa)`` for the CPU
  kernel (a C++ op Inductor calls as an extern kernel; calls above ``max_tokens`` rows take the
  dense GEMM on ``W`` inside it);
- ``nmsparse::sparse_linear(x, W, values, meta, b, kernel, alg_id, min_tokens)`` otherwise.

The decision is first confirmed by timing on the layer's shape: CUDA
(:func:`nmcompile.kernels.dispatch.measure`), CPU (:func:`nmcompile.kernels.dispatch.cpu.measure_cpu`).
"""

from __future__ import annotations

import torch
from torch import fx

from ..kernels.dispatch.cpu import measure_cpu
from ..kernels.dispatch import measure
from ..kernels.deploy_op import compress
from .matching import gemm_uses
from .context import PassContext


def _tokens(x: fx.Node) -> int | None:
    value = x.meta.get("example_value")
    if value is None:
        return None
    count = 1
    for size in value.shape[:-1]:
        if not isinstance(size, int):
            return None  # dynamic
        count *= size
    return count


def rewrite_sparse_gemms(gm: fx.GraphModule, ctx: PassContext) -> int:
    graph = gm.graph
    last = list(graph.find_nodes(op="placeholder"))[-1]
    rewritten = 0
    for i, target in enumerate(ctx.deployed):
        decision = target.decision
        if not decision.sparse:
            continue
        weight = target.param.detach().t() if target.transposed else target.param.detach()  # [out, in]
        values, meta = compress(weight, decision.kernel)
        operands = [gemm_uses.gemm_operands(use, target.node) for use in target.uses]
        if decision.kernel in ("cusparselt", "cpu24"):
            tokens = {_tokens(o["x"]) for o in operands}
            static = tokens.pop() if len(tokens) == 1 else None
            if decision.kernel == "cpu24":
                decision = measure_cpu(decision, weight, target.bias, static)
            else:
                decision = measure(decision, weight, target.bias, values, static, weight.shape[1], ctx.cuda_graphs)
            ctx.deployed[i] = type(target)(**{**target.__dict__, "decision": decision})
            if not decision.sparse:
                continue
        fake_mode = target.node.meta["example_value"].fake_mode
        inputs = []
        for part, example in (("values", values), ("meta", meta)):
            last = gemm_uses.add_input(graph, last, f"nm_{part}_{i}")
            last.meta["example_value"] = fake_mode.from_tensor(example)
            # the same tensor at every call: CUDA graphs (mode="reduce-overhead") read it in place
            # rather than copying the compressed weight into the graph's memory at each replay
            last.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
            inputs.append(last)
        ctx.compressed[target.fqn] = (values, meta)
        w_node = target.node
        if target.transposed:
            with graph.inserting_after(last):
                w_node = graph.call_function(torch.t, (target.node,))
            w_node.meta["example_value"] = target.node.meta["example_value"].t()
        for use, o in zip(target.uses, operands):
            if decision.kernel == "cpu24":
                op = torch.ops.nmsparse.cpu24_linear.default
                args = (o["x"], *inputs, o["bias"], w_node, weight.shape[0], decision.max_tokens, decision.isa)
            else:
                op = torch.ops.nmsparse.sparse_linear.default
                args = (o["x"], w_node, *inputs, o["bias"], decision.kernel, decision.alg_id, decision.min_tokens)
            gemm_uses.replace_call(use, op, args)
            rewritten += 1
    graph.lint()
    gm.recompile()
    return rewritten
