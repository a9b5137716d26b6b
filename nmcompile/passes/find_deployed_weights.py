"""Find the finalized (deployed N:M) weights and decide, per layer, which kernel each gets.

A weight qualifies for a 2:4 kernel when every use is a linear GEMM: ``F.linear(x, W[out, in], b)``,
or GPT-2's Conv1D ``addmm(b, x, W[in, out])`` / ``x @ W[in, out]`` (rewritten on ``W.t()``); convs
and other uses keep the dense GEMM, with the reason recorded. The rules are :func:`nmcompile.kernels.dispatch.qualify`; on CUDA the
candidates are then timed (:func:`~nmcompile.kernels.dispatch.measure`) by the rewrite pass.
No rewriting here.
"""

from __future__ import annotations

from torch import fx, nn

from ..kernels.dispatch import Decision, qualify
from ..kernels.cpu24.weight import PackedLinearWeight
from ..state.records import deployed_of
from .matching import gemm_uses, sources
from .context import DeployTarget, PassContext


def _bias_of(use: fx.Node, weight: fx.Node):
    operands = gemm_uses.gemm_operands(use, weight)
    bias = operands and operands["bias"]
    if isinstance(bias, fx.Node):
        grapharg = bias.meta.get("grapharg")
        example = grapharg.example if grapharg is not None else None
        return example if isinstance(example, nn.Parameter) else None
    return None


def find_deployed_weights(gm: fx.GraphModule, ctx: PassContext) -> int:
    for node, param, source in sources.parameter_placeholders(gm):
        owned = sources.owning_module(source, param)
        record = deployed_of(*owned) if owned else None
        if record is None or isinstance(param, PackedLinearWeight):
            continue  # packed-only weights run their own kernel (their decision was made when packed)
        uses = list(node.users)
        forms = [gemm_uses.gemm_operands(u, node) for u in uses]
        linear = [u for u, f in zip(uses, forms) if f is not None and f["kind"] == "linear"]
        transposed = {f["transposed"] for f in forms if f is not None and f["kind"] == "linear"}
        if len(linear) != len(uses) or not uses or len(transposed) != 1:
            kinds = sorted({
                "torch.utils.checkpoint" if gemm_uses.checkpoint_inputs(u, node) else gemm_uses.use_name(u, node)
                for u in uses if u not in linear
            }) or ["nothing"]
            decision = Decision("dense", f"used by {', '.join(kinds)}; the 2:4 kernels take linear/addmm weights")
            transposed = False
        else:
            (transposed,) = transposed
            reduced = 0 if transposed else 1  # [in, out] weights (GPT-2 Conv1D, x @ W) reduce dim 0
            if record.dim != reduced:
                decision = Decision("dense", f"N:M along dim {record.dim} but its GEMM reduces dim {reduced}")
            else:
                weight = param.detach()
                decision = _forced(qualify, weight.t() if transposed else weight, ctx.deploy_kernel,
                                   sources.parameter_fqn(source))
        bias = _bias_of(linear[0], node) if linear else None  # for timing; each call keeps its own bias
        fqn = sources.parameter_fqn(source)
        ctx.deployed.append(DeployTarget(node, fqn, param, bias, linear, decision, transposed))
    return len(ctx.deployed)


def _forced(rule, weight, kernel: str, fqn: str) -> Decision:
    """``rule(weight, kernel)``; where a forced kernel cannot take the layer, the error names the layer and the fix."""
    try:
        return rule(weight, kernel)
    except ValueError as err:
        out_f, in_f = weight.shape
        pad = ", or pad its features to a multiple of 16" if "multiple of 16" in str(err) else ""
        raise ValueError(
            f"{fqn} ([{out_f}, {in_f}]): {err}. Compile with deploy_kernel='auto', which keeps such a layer dense and "
            f"names it in nmcompile.deploy_report{pad}"
        ) from err
