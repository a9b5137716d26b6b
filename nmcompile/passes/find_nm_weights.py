"""Find the weights to sparsify and their recipes.

Looks at every parameter placeholder of the Dynamo graph, classifies its uses, and resolves its
recipe. Precedence (first that applies wins): ``nmcompile.annotate`` on the parameter, then a
``nmcompile.region`` around its consumer, then the backend ``options``, then ``NMSPARSE_RECIPE``.
Records an :class:`NMTarget` per weight to rewrite and a reason per weight it skips. No rewriting.
"""

from __future__ import annotations

from torch import fx

from ..state.records import annotation_of, deployed_of, state_dict_of
from ..recipes import parse
from . import _graph, _sources
from .context import NMTarget, PassContext


def _resolve(ctx: PassContext, owned, fqn: str, node, users):
    ann = annotation_of(*owned) if owned else None
    if ann is not None:
        return ann.recipe, "annotate"
    if owned and deployed_of(*owned) is not None:
        return None, "finalize"  # deployed: the deploy passes take it
    region = _graph.region_recipe([use for user in users for use, _ in _graph.leaf_uses(user, node)])
    if region is not None:
        return (None if region == "dense" else parse(region)), "region"
    for origin, plan in (("options", ctx.options_plan), ("NMSPARSE_RECIPE", ctx.env_plan)):
        if plan is not None:
            return plan.recipe_for(fqn), origin
    return None, None


def _clock(owned) -> int:
    """The weight's optimizer step now, so that a framed recipe is compiled for its current frame
    (a resumed run, a recompile for dynamic shapes), or 0 for a weight not annotated yet."""
    ann = annotation_of(*owned)
    if ann is None or ann.pending:
        return 0
    try:
        return ann.clock.read(state_dict_of(*owned, ann)["step"])
    except KeyError:  # state buffers removed: the runner recreates them, from step 0
        return 0


def find_nm_weights(gm: fx.GraphModule, ctx: PassContext) -> int:
    found = 0
    for node, param, source in _sources.parameter_placeholders(gm):
        users = list(node.users)
        uses = [_graph.weight_use(user, node) for user in users]
        fqn = _sources.parameter_fqn(source)
        owned = _sources.owning_module(source, param)
        if param.dim() >= 2:
            ctx.weights.append(fqn)
        if not any(kind == "gemm" for kind, _ in uses):
            kinds = sorted({kind for kind, _ in uses})
            if param.dim() < 2 or not users or kinds == ["embedding"]:
                continue  # bias, norm scale, embedding, or not used by this graph
            recipe, origin = _resolve(ctx, owned, fqn, node, users)
            if recipe is not None:  # declared, but this graph cannot rewrite it
                ctx.skipped[fqn] = (
                    f"used only by {', '.join(kinds)}, not as a linear/conv weight; nmcompile rewrites linear, "
                    f"addmm, x @ W, conv1d/conv2d and nn.MultiheadAttention (recipe {recipe} from {origin})"
                )
            continue
        ctx.candidates.append(fqn)
        recipe, origin = _resolve(ctx, owned, fqn, node, users)
        ctx.declared = ctx.declared or origin is not None
        if recipe is None:
            if owned is None and _sources.owner_source(source) is not None and origin is None:
                ctx.skipped[fqn] = (
                    "its owning module cannot be reached from the compiled frame, so a recipe recorded by "
                    "nmcompile.annotate cannot be read; declare it through options={'recipe': ...} instead"
                )
            continue
        skip = None
        dims = {dim for kind, dim in uses if kind == "gemm"}
        others = sorted({kind for kind, _ in uses if kind != "gemm"})
        owner = _sources.owner_source(source)
        if "embedding" in others:
            skip = "tied to an embedding; embeddings and tied weights are never sparsified"
        elif others:
            skip = f"also used by {', '.join(others)}, which nmcompile does not rewrite through"
        elif None in dims:
            skip = _graph.unknown_reduction(users, node) or "no single reduction dimension"
        elif len(dims) > 1:
            skip = "used with two different reduction dimensions"
        elif owner is None:
            skip = "not a module parameter (no owning module to keep recipe state in)"
        else:
            (dim,) = dims
            ann = annotation_of(*owned) if owned else None
            if ann is not None and ann.dim != dim:
                skip = f"annotated for reduction dim {ann.dim} but the graph reduces dim {dim}"
            else:
                skip = recipe.fits(param, dim)
            if skip is None and recipe.rewrites_consumer:
                leaves = [pair for u in users for pair in _graph.leaf_uses(u, node)]
                forms = [(u, _graph.gemm_operands(u, w)) for u, w in leaves]
                fixed = [u.format_node() for u, ops in forms if ops is None]
                if getattr(recipe, "fp8", False) and any(ops and ops["kind"] == "conv" for _, ops in forms):
                    skip = f"{recipe}: the FP8 simulation covers linear GEMMs, not convolutions"
                elif fixed:
                    skip = (
                        f"{recipe} changes the GEMM's backward, which nmcompile can do for linear, addmm, "
                        f"x @ W and batched conv1d/conv2d calls, not for {fixed[0]}"
                    )
        if skip is not None:
            ctx.skipped[fqn] = f"{skip} (recipe {recipe} from {origin})"
            continue
        frame = recipe.frame_at(_clock(owned)) if recipe.framed and owned else None
        ctx.targets.append(NMTarget(node, fqn, recipe, dim, owner[0], owner[1], origin, frame))
        found += 1
    return found
