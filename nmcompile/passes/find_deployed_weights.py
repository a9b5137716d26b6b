"""Find the finalized (deployed N:M) weights and decide, per layer, which kernel each gets.

A weight qualifies for a 2:4 kernel when every use is ``F.linear(x, W[out, in], b)``; other uses
(a conv, GPT-2's Conv1D ``addmm`` with ``[in, out]`` weights, a matmul) keep the dense GEMM, with
the reason recorded. The rules are :func:`nmcompile.backends.dispatch.qualify`; on CUDA the
candidates are then timed (:func:`~nmcompile.backends.dispatch.measure`) by the rewrite pass.
No rewriting here.
"""

from __future__ import annotations

from torch import fx, nn

from ..backends.dispatch import Decision, qualify
from ..finalize import deployed_of
from . import _graph
from .context import DeployTarget, PassContext


def _bias_of(use: fx.Node):
    operands = _graph.gemm_operands(use, use.args[1])
    bias = operands and operands["bias"]
    if isinstance(bias, fx.Node):
        grapharg = bias.meta.get("grapharg")
        example = grapharg.example if grapharg is not None else None
        return example if isinstance(example, nn.Parameter) else None
    return None


def find_deployed_weights(gm: fx.GraphModule, ctx: PassContext) -> int:
    for node, param, source in _graph.parameter_placeholders(gm):
        record = deployed_of(param)
        if record is None:
            continue
        uses = list(node.users)
        linear = [u for u in uses if u.op == "call_function" and u.target in _graph._LINEAR and u.args[1] is node]
        if len(linear) != len(uses) or not uses:
            kinds = sorted({_graph.weight_use(u, node)[0] for u in uses if u not in linear}) or ["nothing"]
            decision = Decision("dense", f"used by {', '.join(kinds)}; the 2:4 kernels take linear weights [out, in]")
        elif record.dim != 1:
            decision = Decision("dense", f"N:M along dim {record.dim}; the 2:4 kernels group along 'in' (dim 1)")
        else:
            decision = qualify(param.detach(), ctx.deploy_kernel)
        bias = _bias_of(linear[0]) if linear else None  # for timing; each call keeps its own bias
        ctx.deployed.append(DeployTarget(node, _graph.parameter_fqn(source), param, bias, linear, decision))
    return len(ctx.deployed)
