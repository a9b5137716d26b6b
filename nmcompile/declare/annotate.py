"""Recording recipes on a model's weights, in place: no module swap, module classes unchanged.

A weight's recipe is recorded with its owning module, under the parameter's name (a
:class:`WeightAnnotation` in the module's records table, :mod:`nmcompile.state.records`), never on the
``nn.Parameter`` object, so anything that replaces parameter objects keeps it. The recipe's state
lives in buffers of the same module named ``<param>_nm_<key>`` (e.g. ``fc1.weight_nm_beta``), so
``state_dict()`` saves and restores it.

State that depends on the weight's values (S-STE's beta, fixed masks, permutations, the step
clock) is computed from real values only. A weight still on the meta device (a model built under
``torch.device("meta")``) gets placeholder buffers and a *pending* annotation; its state is
computed from the weight at the first forward (or ``state_dict()``, whichever comes first), after
``to_empty`` and initialisation, unless a checkpoint filled it in first (``load_state_dict``, or
an in-place load such as ``torch.distributed.checkpoint``, seen by the buffers' version counters).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..state import records
from ..training.step_driver import driver
from ..pattern import NMPattern, reduction_dim
from .plan import Plan
from ..recipes.base import Recipe
from ..state.records import RECIPES, WeightAnnotation, annotation_of, owners, settle, state_dict_of, state_of
from ..state.sharding import full, is_sharded
from .. import masks

__all__ = ["annotate", "AnnotationReport", "attach", "detach_recipe", "WeightAnnotation", "annotation_of", "state_of",
           "state_dict_of"]

SUPPORTED_LAYERS = "nn.Linear, nn.Conv1d, nn.Conv2d, transformers Conv1D, nn.MultiheadAttention"


def attach(module: nn.Module, param_name: str, recipe: Recipe, dim: int, name: str | None = None) -> WeightAnnotation:
    """Record ``recipe`` for ``module.<param_name>`` and create its state from the current weight.

    Re-attaching the same recipe keeps the existing state (S-STE's beta is computed once). A weight
    on the meta device gets placeholder state, computed later from real values.
    """
    param = module._parameters[param_name]
    old = annotation_of(module, param_name)
    if old is not None and old.recipe == recipe and old.dim == dim:
        kept = [module._buffers.get(buffer) for buffer in old.buffer_names(param_name)]
        if (all(b is not None for b in kept) and not old.stale and not records.replaced(module, param_name, old)
                and not records.state_shape_differs(module, param_name, old)):
            return old
    if old is not None:
        for buffer in old.buffer_names(param_name):
            module._buffers.pop(buffer, None)
    ann = WeightAnnotation(recipe, dim, pending=param.is_meta)
    with torch.no_grad(), torch.inference_mode(False):  # state must not be inference tensors
        if ann.pending:  # shapes only (a meta DTensor's shape is the whole weight's)
            state = recipe.example_state(torch.empty(param.shape, dtype=param.dtype, device="meta"), dim)
        else:
            state = recipe.init_state(full(param.detach()), dim)
    for key, buffer in zip(recipe.state_names, ann.buffer_names(param_name)):
        module.register_buffer(buffer, state[key])
    if not ann.pending:
        ann.seen.set(param)
    records.put(module, RECIPES, param_name, ann)
    ann.driver = driver()  # counts steps, and names a declared weight that trains without any nmsparse graph
    ann.driver.watch_module(module, param_name, name or param_name)
    records.drop(module, records.DEPLOYED, param_name)  # a finalized weight that trains again
    _hook(module)
    if recipe.clocked and not ann.pending:  # the clock follows this buffer (and loads into it) from now on
        ann.clock.read(module._buffers[ann.buffer_names(param_name)[recipe.state_names.index("step")]])
    return ann


def detach_recipe(module: nn.Module, param_name: str) -> WeightAnnotation | None:
    """Forget ``module.<param_name>``'s recipe and remove its state buffers; returns the old record."""
    ann = records.drop(module, RECIPES, param_name)
    if ann is not None:
        for buffer in ann.buffer_names(param_name):
            module._buffers.pop(buffer, None)
    return ann


def _hook(module: nn.Module) -> None:
    """Register the module's load and save hooks once (they read its records table when called)."""
    hooks = [getattr(h, "hook", h) for h in module._load_state_dict_pre_hooks.values()]
    if _before_load not in hooks:
        module.register_load_state_dict_pre_hook(_before_load)
        module.register_state_dict_pre_hook(_before_save)


def _before_save(module, prefix, keep_vars) -> None:
    """Pending state is computed before it is saved."""
    for pname, ann in list(records.table(module, RECIPES).items()):
        if ann.pending and pname in module._parameters:
            settle(module, pname, ann)


def _before_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    """Check a checkpoint's recipe state for each annotated weight of ``module`` before it is copied.

    - State of another recipe (keys ``<param>_nm_<key>`` this recipe does not have): a warning naming
      the weight and both sets of keys; ``load_state_dict`` then refuses them as unexpected keys
      (``strict=False`` drops them).
    - No state for this recipe but a weight (a dense checkpoint, or one from another recipe): the
      state is computed from the incoming weight, as ``annotate`` after loading would, with a warning.
    - A stored mask that breaks the recipe's N:M pattern (saved with another pattern): an error.
    - State in the checkpoint settles a pending annotation (it is not computed again).
    - With ``assign=True`` the loaded tensors become the weight and its state, so computed state is
      made where the incoming weight is. A load that leaves weight or state on the meta device (a
      copy into a meta model is a no-op) leaves a pending annotation pending.
    ``state_dict`` is ``load_state_dict``'s own copy, so filling it in leaves the caller's dict as it was.
    """
    assign = bool(local_metadata.get("assign_to_params_buffers", False))
    for pname, ann in list(records.table(module, RECIPES).items()):
        if pname not in module._parameters:
            continue
        ann.seen.set(None)  # the state now goes with the weight as loaded: the next look takes it
        ann.copy_of, ann.averaged = None, None  # the checkpoint's state, not a copy's
        weight_key, recipe = prefix + pname, ann.recipe
        ours = dict(zip(ann.buffer_names(pname), recipe.state_names))
        theirs = [k for k in state_dict if k.startswith(f"{weight_key}_nm_") and k[len(prefix):] not in ours]
        if theirs:  # (``strict`` is always True here: load_state_dict decides on unexpected keys afterwards)
            warnings.warn(
                f"nmcompile: {weight_key} carries {recipe} (state: {', '.join(prefix + k for k in ours) or 'none'}), "
                f"but the checkpoint holds {', '.join(theirs)}: it was saved with another recipe. load_state_dict "
                "refuses it as unexpected keys, or drops it with strict=False; to keep it, annotate the model with "
                "the checkpoint's recipe before loading",
                stacklevel=2,
            )
        param = module._parameters[pname]
        incoming_weight = state_dict.get(weight_key)
        if incoming_weight is None or tuple(incoming_weight.shape) == tuple(param.shape):
            for k, key in ours.items():  # state of another shape: a recipe setting differs, say which
                incoming, buffer = state_dict.get(prefix + k), module._buffers.get(k)
                if isinstance(incoming, torch.Tensor) and buffer is not None and incoming.shape != buffer.shape:
                    why = recipe.state_mismatch(key, tuple(incoming.shape)) or (
                        "it was saved with other recipe settings; annotate the model with the checkpoint's recipe "
                        "before loading"
                    )
                    error_msgs.append(
                        f"{prefix + k} in the checkpoint has shape {list(incoming.shape)}, but {recipe} on {weight_key} "
                        f"makes it {list(buffer.shape)}: {why}"
                    )
                    state_dict[prefix + k] = buffer  # in place of PyTorch's size-mismatch message for the key
        absent = [k for k in ours if prefix + k not in state_dict]
        # where the weight is after this load: the incoming tensor (assign), else the parameter as it is
        weight_after = state_dict.get(weight_key) if assign and weight_key in state_dict else param
        if absent and weight_key in state_dict and weight_after.is_meta:
            for k in absent:  # nothing to compute from: the placeholders stay (a no-op copy) and pending
                if module._buffers.get(k) is not None:
                    state_dict[prefix + k] = module._buffers[k]
        elif absent and weight_key in state_dict:
            with torch.no_grad():
                incoming = full(state_dict[weight_key]).to(weight_after.device)
                fresh = recipe.init_state(incoming, ann.dim)
            for k in absent:
                state_dict[prefix + k] = fresh[ours[k]]
            warnings.warn(
                f"nmcompile: the checkpoint has no {recipe} state for {weight_key} "
                f"({', '.join(prefix + k for k in absent)}); it was computed from the loaded weight, as "
                "nmcompile.annotate after loading would",
                stacklevel=2,
            )
        state_after = [state_dict.get(prefix + k) if assign else module._buffers.get(k) for k in ours]
        if (all(prefix + k in state_dict for k in ours) and not weight_after.is_meta
                and not any(t is None or t.is_meta for t in state_after)):
            ann.pending = False
        count_key = f"{weight_key}_nm_count"
        if "count" in recipe.state_names and isinstance(state_dict.get(count_key), torch.Tensor):
            # a checkpoint taken during a sequential finalize holds its pause (-1): read as 0 tokens
            state_dict[count_key] = state_dict[count_key].clamp(min=0)
        mask_key = f"{weight_key}_nm_mask"
        if "mask" in recipe.state_names and mask_key in state_dict and mask_key[len(prefix):] in ours:
            mask = state_dict[mask_key]
            if mask.shape == module._parameters[pname].shape and not mask.is_meta:
                values = full(mask)
                other = values[(values != 0) & (values != 1)]
                if other.numel():  # a mask is 0/1: other values would scale the kept weights
                    state_dict[mask_key] = module._buffers[mask_key[len(prefix):]]
                    error_msgs.append(
                        f"{mask_key} in the checkpoint holds values other than 0 and 1 ({other.numel()} of them, e.g. "
                        f"{float(other.flatten()[0]):g}); a mask keeps or drops a weight, and those values would scale "
                        "the kept weights. It was not loaded: save the mask as the model holds it (an averaged mask, "
                        "from AveragedModel(use_buffers=True), is not one), or annotate after loading the weights"
                    )
                    continue
                bad, total = masks.count_violations(values, recipe.n, recipe.m, ann.dim)
                if bad:  # load_state_dict copies the rest before raising: keep this weight's valid mask
                    state_dict[mask_key] = module._buffers[mask_key[len(prefix):]]
                    error_msgs.append(
                        f"{mask_key} in the checkpoint is not {recipe.n}:{recipe.m} ({bad} of {total} groups keep "
                        f"more): it was saved with another pattern than {recipe}. Annotate the model with the "
                        "checkpoint's recipe before loading"
                    )


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


def skip_reason(places, recipe: Recipe | NMPattern) -> tuple[str | None, int | None]:
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


def annotate(model: nn.Module, recipe_or_rules, *, include=None, exclude=None, default_dense=None,
             strict: bool = False) -> AnnotationReport:
    """Record N:M recipes on ``model``'s weights in place and create their state as buffers.

    Works before or after FSDP2's ``fully_shard``, on a model built on the meta device (state is
    then computed from the initialised weights at the first forward), and on a ``torch.compile``'d
    model (names are those of the original module).

    Args:
        model: any ``nn.Module``; its classes and forward code are left as they are.
        recipe_or_rules: a recipe (``"sr_ste:2:4"``, ``nmcompile.recipes.SRSTE()``), a TOML rules
            path, a ``{glob: recipe}`` dict or ``(glob, recipe)`` pairs. First matching rule wins.
        include, exclude: globs over parameter or module names.
        default_dense: globs over module names that catch-all rules do not reach (default: output
            heads and MoE routers, see :mod:`nmcompile.declare.defaults`); ``[]`` turns them off.
        strict: raise ``ValueError`` instead of skipping a selected weight that cannot take its recipe.

    Returns:
        An :class:`AnnotationReport` naming every annotated weight and every skipped one with why.

    Example::

        report = nmcompile.annotate(model, "sr_ste:2:4", exclude=["classifier"])
        compiled = torch.compile(model, backend="nmsparse")
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"annotate takes an nn.Module, got {type(model).__name__}")
    plan = Plan.build(recipe_or_rules, include=include, exclude=exclude, default_dense=default_dense)
    unmatched = plan.unmatched_filters(name for name, _ in owners(model))
    if unmatched:
        warnings.warn(f"nmcompile.annotate: {'; '.join(unmatched)}", stacklevel=2)
    report = AnnotationReport()
    chosen = []
    for name, places in owners(model):
        _, module, pname = places[0]
        if module._parameters[pname].dim() < 2:
            continue  # biases and norm scales are not N:M candidates
        shape = tuple(module._parameters[pname].shape)
        recipe = plan.recipe_for(name, shape)
        if recipe is None:
            report.skipped[name] = plan.filtered_out(name, shape) or "no rule selects it (kept dense)"
            continue
        reason, dim = skip_reason(places, recipe)
        if reason is not None:
            if strict:
                raise ValueError(f"cannot apply {recipe} to {name!r}: {reason}")
            report.skipped[name] = reason
            continue
        chosen.append((name, module, pname, recipe, dim))
    if strict and not chosen:
        raise ValueError(f"annotate(strict=True): the declaration selects no weight of "
                         f"{type(records.root(model)).__name__}\n{report}")
    for recipe in dict.fromkeys(r for *_, r, _ in chosen):  # model-level work first (ASP permutes)
        weights = [(n, m._parameters[p]) for n, m, p, r, _ in chosen if r == recipe]
        if recipe.prepares_model:
            _check_preparable(recipe, weights)
        report.prepared[str(recipe)] = recipe.prepare(records.root(model), [n for n, _ in weights])
    for name, module, pname, recipe, dim in chosen:
        attach(module, pname, recipe, dim, name)
        report.annotated[name] = recipe
    if not chosen:
        warnings.warn(f"nmcompile.annotate: no weight was annotated\n{report}", stacklevel=2)
    return report


def _check_preparable(recipe: Recipe, weights) -> None:
    """A recipe that rewrites the model's weights (channel permutation) needs whole, real weights."""
    sharded = [n for n, p in weights if is_sharded(p)]
    if sharded:
        raise ValueError(
            f"{recipe} rewrites the model's weights before pruning (channel permutation), which FSDP2's "
            f"sharded weights ({sharded[0]}, ...) do not keep; call nmcompile.annotate(model, {str(recipe)!r}) "
            f"before fully_shard, or use '{recipe},permute=False'"
        )
    meta = [n for n, p in weights if p.is_meta]
    if meta:
        raise ValueError(
            f"{recipe} permutes channels by the weights' values, and {meta[0]} is on the meta device; "
            f"annotate after to_empty and weight initialisation, or use '{recipe},permute=False'"
        )
