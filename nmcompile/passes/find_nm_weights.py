"""Find the weights to sparsify and their recipes.

Looks at every parameter placeholder of the Dynamo graph, classifies its uses, and resolves its
recipe. Precedence (first that applies wins): ``nmcompile.annotate`` on the parameter, then a
``nmcompile.region`` around its consumer, then the backend ``options``, then ``NMSPARSE_RECIPE``.
Records an :class:`NMTarget` per weight to rewrite and a reason per weight it skips. No rewriting.
"""

from __future__ import annotations

from torch import fx, nn
from torch.nn.utils import parametrize

from ..state import records
from ..state.records import annotation_of, deployed_of, owners, state_dict_of
from ..declare.defaults import default_reason
from ..recipes import parse
from .matching import calibration_routes, gemm_uses, sources
from .context import NMTarget, PassContext


def _resolve(ctx: PassContext, owned, fqn: str, node, users):
    ann = annotation_of(*owned) if owned else None
    if ann is not None:
        return ann.recipe, "annotate"
    if owned and deployed_of(*owned) is not None:
        return None, "finalize"  # deployed: the deploy passes take it
    shape = tuple(node.meta["example_value"].shape) if "example_value" in node.meta else None
    region = gemm_uses.region_recipe([use for user in users for use, _ in gemm_uses.leaf_uses(user, node)])
    if region is not None:
        if region == "dense":
            return None, "region"
        why = default_reason(fqn, shape)
        if why is not None:  # a region names no weight: heads and routers in it stay dense
            ctx.by_default[fqn] = (why + "; a region names no weight, so declare it by name: "
                                   "nmcompile.annotate(model, {name: recipe}) or options={'recipe': {name: recipe}}")
            return None, "region"
        return parse(region), "region"
    for origin, plan in (("options", ctx.options_plan), ("NMSPARSE_RECIPE", ctx.env_plan)):
        if plan is not None:
            recipe = plan.recipe_for(fqn, shape)
            why = plan.kept_by_default(fqn, shape) if recipe is None else None
            if why is not None and not plan.default_dense_given:
                ctx.by_default[fqn] = f"{why} (from {origin})"
            return recipe, origin
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


class _Model:
    """The compiled module's weights as its modules hold them (looked up once per graph, when needed)."""

    def __init__(self, source):
        self.source, self._root, self._holders = source, None, None

    @property
    def root(self) -> nn.Module | None:
        if self._root is None:
            self._root = sources.root_module(self.source)
        return self._root

    def holders(self, param) -> list[tuple[str, nn.Module, str]]:
        """Every (name, module, attribute) holding ``param`` (several: a tied weight)."""
        if self._holders is None:
            self._holders = {}
            if self.root is not None:
                for _, places in owners(self.root):
                    _, module, pname = places[0]
                    self._holders[id(module._parameters[pname])] = [
                        (f"{m}.{p}" if m else p, mod, p) for m, mod, p in places
                    ]
        return self._holders.get(id(param), [])


def _parametrized(model: _Model, fqn: str, owned):
    """``(name, module, attribute)`` of a declared weight a parametrization now computes, or None.

    ``torch.nn.utils.parametrize.register_parametrization(module, "weight", ...)`` moves the
    parameter to ``module.parametrizations.weight.original``: the graph's placeholder is that one,
    and the layer uses the parametrization's output, which is no parameter.
    """
    if owned is None or not isinstance(owned[0], parametrize.ParametrizationList) or model.root is None:
        return None
    parts = fqn.split(".")
    if "parametrizations" not in parts[:-2]:
        return None
    at = len(parts) - 1 - parts[::-1].index("parametrizations")
    try:
        module = model.root.get_submodule(".".join(parts[:at]))
    except AttributeError:
        return None
    tensor = parts[at + 1] if at + 1 < len(parts) else None
    if tensor is None or annotation_of(module, tensor) is None:
        return None
    return ".".join(parts[:at] + [tensor]), module, tensor


def _tie(places) -> tuple[str | None, list]:
    """Why a weight tied after ``nmcompile.annotate`` cannot take its declaration (None: all holders
    declare the same recipe), and the holders' records."""
    anns = [(name, annotation_of(module, pname), module) for name, module, pname in places]
    declared = [ann for _, ann, _ in anns if ann is not None]
    names = ", ".join(name for name, _, _ in anns)
    embedding = [name for name, _, module in anns if isinstance(module, (nn.Embedding, nn.EmbeddingBag))]
    if embedding:
        return (f"tied to an embedding ({embedding[0]}; holders: {names}); embeddings and tied weights are never "
                "sparsified"), declared
    if len(declared) < len(anns) or len({(ann.recipe, ann.dim) for ann in declared}) > 1:
        said = "; ".join(f"{name}: {ann.recipe if ann is not None else 'not declared'}" for name, ann, _ in anns)
        return (f"tied weight shared by {names}, which carry different declarations ({said}); declare the same "
                "recipe for every holder, or untie them"), declared
    return None, declared


def find_nm_weights(gm: fx.GraphModule, ctx: PassContext) -> int:
    found = 0
    model = None
    for node, param, source in sources.parameter_placeholders(gm):
        users = list(node.users)
        uses = [gemm_uses.weight_use(user, node) for user in users]
        fqn = sources.parameter_fqn(source)
        owned = sources.owning_module(source, param)
        model = model or _Model(source)
        if param.dim() >= 2:
            ctx.weights.append(fqn)
        hidden = _parametrized(model, fqn, owned)
        if hidden is not None:
            name, module, tensor = hidden
            ann = annotation_of(module, tensor)
            reason = records.parametrized_reason(name, ann.recipe) + f" (its parameter is now {fqn})"
            ctx.skipped[name] = reason
            ctx.named.append((ann, reason))
            ctx.declared = True
            continue
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
                if origin == "annotate":
                    ctx.named.append((annotation_of(*owned), ctx.skipped[fqn]))
            continue
        ctx.candidates.append(fqn)
        places = model.holders(param)
        if len(places) > 1:  # tied (after annotate, which declares no tied weight)
            why, declared = _tie(places)
            if declared and why is not None:
                reason = f"{why} (recipe {declared[0].recipe} from annotate)"
                ctx.skipped[fqn] = reason
                ctx.named.extend((ann, reason) for ann in declared)
                ctx.declared = True
                continue
        recipe, origin = _resolve(ctx, owned, fqn, node, users)
        ctx.declared = ctx.declared or origin is not None
        if recipe is None:
            if owned is None and sources.owner_source(source) is not None and origin is None:
                ctx.skipped[fqn] = (
                    "its owning module cannot be reached from the compiled frame, so a recipe recorded by "
                    "nmcompile.annotate cannot be read; declare it through options={'recipe': ...} instead"
                )
            continue
        skip = None
        dims = {dim for kind, dim in uses if kind == "gemm"}
        others = sorted({kind for kind, _ in uses if kind != "gemm"})
        owner = sources.owner_source(source)
        if "embedding" in others:
            skip = "tied to an embedding; embeddings and tied weights are never sparsified"
        elif others:
            skip = f"also used by {', '.join(others)}, which nmcompile does not rewrite through"
        elif None in dims:
            skip = gemm_uses.unknown_reduction(users, node) or "no single reduction dimension"
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
                leaves = [pair for u in users for pair in gemm_uses.leaf_uses(u, node)]
                forms = [(u, gemm_uses.gemm_operands(u, w)) for u, w in leaves]
                fixed = [u.format_node() for u, ops in forms if ops is None]
                if getattr(recipe, "fp8", False) and any(ops and ops["kind"] == "conv" for _, ops in forms):
                    skip = f"{recipe}: the FP8 simulation covers linear GEMMs, not convolutions"
                elif fixed:
                    skip = (
                        f"{recipe} changes the GEMM's backward, which nmcompile can do for linear, addmm, "
                        f"x @ W and batched conv1d/conv2d calls, not for {fixed[0]}"
                    )
        if skip is None and recipe.calibrated:
            routes = calibration_routes.calibration_routes(node, dim)
            if isinstance(routes, str):
                skip = f"{routes}, so its calibration statistics cannot be gathered"
        if skip is not None:
            ctx.skipped[fqn] = f"{skip} (recipe {recipe} from {origin})"
            ann = annotation_of(*owned) if owned else None
            if ann is not None:
                ctx.named.append((ann, ctx.skipped[fqn]))
            continue
        ann = annotation_of(*owned) if owned else None
        if ann is not None and records.state_shape_differs(*owned, ann):
            records.refresh(*owned, ann, fqn)  # replaced by a weight of another shape after annotate
        frame = recipe.frame_at(_clock(owned)) if recipe.framed and owned else None
        ctx.targets.append(NMTarget(node, fqn, recipe, dim, owner[0], owner[1], origin, frame))
        found += 1
    return found
