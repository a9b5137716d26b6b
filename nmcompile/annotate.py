"""Recording recipes on a model's weights, in place: no module swap, module classes unchanged.

A weight's recipe is recorded on its ``nn.Parameter`` (attribute ``_nmcompile``, a frozen
:class:`WeightAnnotation`). The recipe's state lives in buffers of the owning module named
``<param>_nm_<key>`` (e.g. ``fc1.weight_nm_beta``), so ``state_dict()`` saves and restores it.
``copy.deepcopy`` of a model keeps both: ``nn.Parameter``'s own deep copy drops attributes, so the
annotation, reached through the owning module's load hooks, records itself on the copied parameters.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .clock import StepMirror
from .diagnostics import Trace
from .pattern import NMPattern, reduction_dim
from .plan import Plan
from .recipes.base import Recipe
from .sharding import fsdp_modules, unsharded

__all__ = ["annotate", "AnnotationReport", "WeightAnnotation", "attach", "annotation_of", "state_of"]

ATTR = "_nmcompile"
#: attribute of a weight that nmcompile.finalize baked (its Deployed record)
DEPLOY_ATTR = "_nmcompile_deployed"
SUPPORTED_LAYERS = "nn.Linear, nn.Conv1d, nn.Conv2d, transformers Conv1D, nn.MultiheadAttention"


@dataclass(frozen=True)
class WeightAnnotation:
    recipe: Recipe
    dim: int  # the grouping (reduction) dimension of the weight
    # run-time companions, not part of the declaration (excluded from equality):
    clock: StepMirror = field(default_factory=StepMirror, compare=False, repr=False)
    trace: Trace = field(default_factory=Trace, compare=False, repr=False)  # diagnostics
    hooks: list = field(default_factory=list, compare=False, repr=False)  # load_state_dict hook handles

    def __deepcopy__(self, memo) -> WeightAnnotation:
        """A copy for a copied model (reached through the module's load hooks, which deep-copy with it).

        The parameters carrying this record were copied first (``Module.__dict__`` holds
        ``_parameters`` before the hooks); ``memo`` lists the originals it copied, and each copy of
        one of ours gets the new record.
        """
        twin = WeightAnnotation(self.recipe, self.dim)
        memo[id(self)] = twin  # before its fields: the hook handles lead back here
        for name in ("clock", "trace", "hooks"):
            object.__setattr__(twin, name, copy.deepcopy(getattr(self, name), memo))
        mark_copies(memo, ATTR, self, twin)
        return twin

    def detach_hooks(self) -> None:
        detach(self.hooks)

    def buffer_names(self, param_name: str) -> tuple[str, ...]:
        return tuple(f"{param_name}_nm_{key}" for key in self.recipe.state_names)


def mark_copies(memo: dict, attr: str, record, twin) -> None:
    """During ``copy.deepcopy``: set ``attr`` to ``twin`` on the copy of every parameter whose
    ``attr`` is ``record`` (``nn.Parameter``'s own deep copy drops attributes).

    The parameters were copied before the module hooks that lead here (``Module.__dict__`` holds
    ``_parameters`` first), and ``memo[id(memo)]`` lists the originals deepcopy has copied.
    """
    for original in memo.get(id(memo), ()):
        if isinstance(original, nn.Parameter) and getattr(original, attr, None) is record:
            param_copy = memo.get(id(original))
            if isinstance(param_copy, nn.Parameter) and not hasattr(param_copy, attr):
                setattr(param_copy, attr, twin)


def detach(handles: list) -> None:
    """Remove the hooks behind ``handles`` and forget them."""
    for handle in handles:
        handle.remove()
    handles.clear()


def annotation_of(param: torch.Tensor) -> WeightAnnotation | None:
    return getattr(param, ATTR, None)


def state_of(module: nn.Module, param_name: str, ann: WeightAnnotation) -> tuple[torch.Tensor, ...]:
    buffers = module._buffers
    return tuple(buffers[name] for name in ann.buffer_names(param_name))


def state_dict_of(module: nn.Module, param_name: str, ann: WeightAnnotation) -> dict[str, torch.Tensor]:
    """``{state key: tensor}`` of one annotated weight."""
    return dict(zip(ann.recipe.state_names, state_of(module, param_name, ann)))


def attach(module: nn.Module, param_name: str, recipe: Recipe, dim: int) -> WeightAnnotation:
    """Record ``recipe`` on ``module.<param_name>`` and create its state from the current weight.

    Re-attaching the same recipe keeps the existing state (S-STE's beta is computed once).
    """
    param = module._parameters[param_name]
    old = annotation_of(param)
    if old is not None and old.recipe == recipe and old.dim == dim:
        if all(name in module._buffers for name in old.buffer_names(param_name)):
            return old
    old = old or _hooked_annotation(module, param_name)  # the record of a parameter object since replaced
    if old is not None:
        old.detach_hooks()
        for name in old.buffer_names(param_name):
            module._buffers.pop(name, None)
    ann = WeightAnnotation(recipe, dim)
    with torch.no_grad(), torch.inference_mode(False):  # state made under inference_mode must still train
        state = recipe.init_state(param, dim)
    for key, name in zip(recipe.state_names, ann.buffer_names(param_name)):
        module.register_buffer(name, state[key])
    setattr(param, ATTR, ann)
    if recipe.clocked:  # the clock follows this buffer (and loads into it) from now on
        ann.clock.read(module._buffers[ann.buffer_names(param_name)[recipe.state_names.index("step")]])
    ann.hooks.append(module.register_load_state_dict_pre_hook(functools.partial(_before_load, param_name, ann)))
    ann.hooks.append(module.register_load_state_dict_post_hook(functools.partial(_after_load, param_name, ann)))
    if hasattr(param, DEPLOY_ATTR):  # a finalized weight that trains again
        detach(getattr(param, DEPLOY_ATTR).hooks)
        delattr(param, DEPLOY_ATTR)
    return ann


def _hooked_annotation(module: nn.Module, param_name: str) -> WeightAnnotation | None:
    """The annotation that ``module``'s nmcompile load hook keeps for ``param_name``, if any."""
    for wrapped in module._load_state_dict_pre_hooks.values():
        hook = getattr(wrapped, "hook", None)
        if isinstance(hook, functools.partial) and hook.func is _before_load and hook.args[0] == param_name:
            return hook.args[1]
    return None


def _before_load(pname: str, ann: WeightAnnotation, module, state_dict, prefix, local_metadata, strict,
                 missing_keys, unexpected_keys, error_msgs) -> None:
    """Check a checkpoint's recipe state for one weight before ``load_state_dict`` copies it.

    - State of another recipe (keys ``<param>_nm_<key>`` this recipe does not have): a warning naming
      the weight and both sets of keys; ``load_state_dict`` then refuses them as unexpected keys
      (``strict=False`` drops them).
    - No state for this recipe but a weight (a dense checkpoint, or one from another recipe): the
      state is computed from the incoming weight, as ``annotate`` after loading would, with a warning.
    - A stored mask that breaks the recipe's N:M pattern (saved with another pattern): an error.
    ``state_dict`` is ``load_state_dict``'s own copy, so filling it in leaves the caller's dict as it was.
    """
    from . import masks
    from .sharding import full

    weight_key, recipe = prefix + pname, ann.recipe
    ours = dict(zip(ann.buffer_names(pname), recipe.state_names))
    theirs = [k for k in state_dict if k.startswith(f"{weight_key}_nm_") and k[len(prefix):] not in ours]
    if theirs:  # (``strict`` is always True here: load_state_dict decides on unexpected keys afterwards)
        warnings.warn(
            f"nmcompile: {weight_key} carries {recipe} (state: {', '.join(prefix + k for k in ours) or 'none'}), but the "
            f"checkpoint holds {', '.join(theirs)}: it was saved with another recipe. load_state_dict refuses it as "
            "unexpected keys, or drops it with strict=False; to keep it, annotate the model with the checkpoint's "
            "recipe before loading",
            stacklevel=2,
        )
    absent = [k for k in ours if prefix + k not in state_dict]
    if absent and weight_key in state_dict:
        with torch.no_grad():
            incoming = full(state_dict[weight_key]).to(module._parameters[pname].device)
            fresh = recipe.init_state(incoming, ann.dim)
        for k in absent:
            state_dict[prefix + k] = fresh[ours[k]]
        warnings.warn(
            f"nmcompile: the checkpoint has no {recipe} state for {weight_key} ({', '.join(prefix + k for k in absent)}); "
            "it was computed from the loaded weight, as nmcompile.annotate after loading would",
            stacklevel=2,
        )
    mask_key = f"{weight_key}_nm_mask"
    if "mask" in recipe.state_names and mask_key in state_dict and mask_key[len(prefix):] in ours:
        mask = state_dict[mask_key]
        if mask.shape == module._parameters[pname].shape:
            bad, total = masks.count_violations(full(mask), recipe.n, recipe.m, ann.dim)
            if bad:  # load_state_dict copies the rest before raising: keep this weight's valid mask
                state_dict[mask_key] = module._buffers[mask_key[len(prefix):]]
                error_msgs.append(
                    f"{mask_key} in the checkpoint is not {recipe.n}:{recipe.m} ({bad} of {total} groups keep more): "
                    f"it was saved with another pattern than {recipe}. Annotate the model with the checkpoint's "
                    "recipe before loading"
                )


def keep_on_new_parameter(module: nn.Module, pname: str, attr: str, record) -> None:
    """After ``load_state_dict(assign=True)`` put a new parameter object in place: it carries
    ``record`` as ``attr`` too, unless it already has a recipe or deploy record."""
    param = module._parameters.get(pname)
    if param is not None and not hasattr(param, ATTR) and not hasattr(param, DEPLOY_ATTR):
        setattr(param, attr, record)


def _after_load(pname: str, ann: WeightAnnotation, module, incompatible_keys) -> None:
    keep_on_new_parameter(module, pname, ATTR, ann)


@dataclass
class AnnotationReport:
    """Which weights got which recipe, and which were skipped and why."""

    annotated: dict[str, Recipe] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    prepared: dict[str, object] = field(default_factory=dict)  # recipe string -> its model-level report

    def __str__(self) -> str:
        lines = [f"nmcompile: {len(self.annotated)} weights annotated, {len(self.skipped)} skipped"]
        lines += [f"  + {name}: {recipe}" for name, recipe in self.annotated.items()]
        lines += [f"  - {name}: {reason}" for name, reason in self.skipped.items()]
        lines += [f"  {recipe}: {report}" for recipe, report in self.prepared.items() if report is not None]
        return "\n".join(lines)


def _owners(model: nn.Module) -> Iterator[tuple[str, list[tuple[str, nn.Module, str]]]]:
    """Each distinct parameter once, with every (module name, module, attribute) that holds it."""
    holders: dict[int, list[tuple[str, nn.Module, str]]] = {}
    seen: set[tuple[int, str]] = set()
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, param in module._parameters.items():
            if param is None or (id(module), pname) in seen:
                continue
            seen.add((id(module), pname))
            holders.setdefault(id(param), []).append((mname, module, pname))
    for places in holders.values():
        mname, _, pname = places[0]
        yield (f"{mname}.{pname}" if mname else pname), places


def _skip_reason(places, recipe: Recipe | NMPattern) -> tuple[str | None, int | None]:
    mname, module, pname = places[0]
    param = module._parameters[pname]
    embedding = [m for m, mod, _ in places if isinstance(mod, (nn.Embedding, nn.EmbeddingBag))]
    if embedding:
        other = [f"{m}.{p}" for m, _, p in places if m not in embedding]
        tied = f", tied to {', '.join(other)}" if other else ""
        return f"embedding weight ({embedding[0]}){tied}; embeddings are never sparsified", None
    if len(places) > 1:
        names = ", ".join(f"{m}.{p}" for m, _, p in places)
        return f"tied weight shared by {names}; tied weights are never sparsified", None
    if not param.is_floating_point():
        return f"dtype {param.dtype} is not floating point; integer weights are skipped", None
    dim = reduction_dim(module, pname, param)
    if dim is None:
        return (
            f"no known N:M layout for {type(module).__name__}.{pname}; supported: {SUPPORTED_LAYERS} "
            "(other layers are found by torch.compile(..., backend='nmsparse', options={'recipe': ...}))"
        ), None
    return recipe.fits(param, dim), dim


def annotate(model: nn.Module, recipe_or_rules, *, include=None, exclude=None, strict: bool = False) -> AnnotationReport:
    """Record N:M recipes on ``model``'s weights in place and create their state as buffers.

    Args:
        model: any ``nn.Module``; its classes and forward code are left as they are.
        recipe_or_rules: a recipe (``"sr_ste:2:4"``, ``nmcompile.recipes.SRSTE()``), a TOML rules
            path, a ``{glob: recipe}`` dict or ``(glob, recipe)`` pairs. First matching rule wins.
        include, exclude: globs over parameter or module names.
        strict: raise ``ValueError`` instead of skipping a selected weight that cannot take its recipe.

    Returns:
        An :class:`AnnotationReport` naming every annotated weight and every skipped one with why.

    Example::

        report = nmcompile.annotate(model, "sr_ste:2:4", exclude=["classifier"])
        compiled = torch.compile(model, backend="nmsparse")
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"annotate takes an nn.Module, got {type(model).__name__}")
    plan = Plan.build(recipe_or_rules, include=include, exclude=exclude)
    if not fsdp_modules(model):
        return _annotate(model, plan, strict)
    # FSDP2: state is computed from the whole weights, and both parameter objects of each weight
    # (the unsharded one the forward uses, the sharded one the optimizer updates) carry the annotation
    with unsharded(model):
        report = _annotate(model, plan, strict, sharded=True)
        owners = [places[0][1:] for _, places in _owners(model)]  # (module, parameter name)
        anns = [(m, p, annotation_of(m._parameters[p])) for m, p in owners]
    for module, pname, ann in anns:
        if ann is not None:
            setattr(module._parameters[pname], ATTR, ann)
    return report


def _annotate(model: nn.Module, plan: Plan, strict: bool, sharded: bool = False) -> AnnotationReport:
    report = AnnotationReport()
    chosen = []
    for name, places in _owners(model):
        _, module, pname = places[0]
        if module._parameters[pname].dim() < 2:
            continue  # biases and norm scales are not N:M candidates
        recipe = plan.recipe_for(name)
        if recipe is None:
            report.skipped[name] = plan.filtered_out(name) or "no rule selects it (kept dense)"
            continue
        reason, dim = _skip_reason(places, recipe)
        if reason is not None:
            if strict:
                raise ValueError(f"cannot apply {recipe} to {name!r}: {reason}")
            report.skipped[name] = reason
            continue
        chosen.append((name, module, pname, recipe, dim))
    for recipe in dict.fromkeys(r for *_, r, _ in chosen):  # model-level work first (ASP permutes)
        if sharded and recipe.prepares_model:
            raise ValueError(
                f"{recipe} rewrites the model's weights before pruning (channel permutation), which FSDP2's "
                f"sharded weights do not keep; call nmcompile.annotate(model, {str(recipe)!r}) before fully_shard "
                f"to permute, then nmcompile.annotate(model, '{recipe},permute=False') after it"
            )
        report.prepared[str(recipe)] = recipe.prepare(model, [n for n, *_, r, _ in chosen if r == recipe])
    for name, module, pname, recipe, dim in chosen:
        attach(module, pname, recipe, dim)
        report.annotated[name] = recipe
    return report
