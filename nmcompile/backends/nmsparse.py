"""The ``nmsparse`` Dynamo backend (found through the ``torch_dynamo_backends`` entry point).

``torch.compile(model, backend="nmsparse", options={...})``:

1. copies Dynamo's graph and runs :data:`nmcompile.passes.TRAIN_PASSES` on the copy, which inserts
   each selected weight's recipe ops and adds recipe state as extra graph inputs;
2. compiles the copy with Inductor (``compile_fx`` with scoped ``config_patches``), or with
   ``aot_eager``/``eager`` when ``options={"inner": ...}`` asks for it;
3. adds to Dynamo's graph one input per owning module (sourced like the weights), so every call
   receives the modules of the instance being run. The returned callable reads each weight's state
   from its module, or creates it the first time it meets an instance that was declared through
   options, ``NMSPARSE_RECIPE`` or a region. One compiled graph thus serves every instance of a
   model class, each with its own state.
"""

from __future__ import annotations

import difflib
import logging

import torch
from torch import fx

from .. import ops
from ..annotate import ATTR, attach
from ..passes import TRAIN_PASSES, PassContext, run_passes
from ..plan import Plan

__all__ = ["nmsparse_backend"]

log = logging.getLogger("nmcompile")

NM_OPTIONS = ("recipe", "include", "exclude", "inner")
INNER = ("inductor", "aot_eager", "eager")


def _inductor_keys() -> set[str]:
    import torch._inductor.config as inductor_config

    return set(inductor_config._config)


def parse_options(options, mode):
    """``(plan or None, inner compiler name, Inductor config patches)`` from the backend options."""
    options = dict(options or {})
    recipe = options.pop("recipe", None)
    include, exclude = options.pop("include", None), options.pop("exclude", None)
    inner = options.pop("inner", "inductor")
    if inner not in INNER:
        raise ValueError(f"nmsparse option inner={inner!r} is not one of {', '.join(INNER)}")
    if recipe is None and (include or exclude):
        raise ValueError("nmsparse options include/exclude need a 'recipe' to filter")
    plan = Plan.build(recipe, include=include, exclude=exclude) if recipe is not None else None
    patches = {}
    if mode not in (None, "default"):
        patches.update(torch._inductor.list_mode_options(mode))
    known = _inductor_keys()
    for key, value in options.items():
        if key not in known:
            close = difflib.get_close_matches(key, [*NM_OPTIONS, *known], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown nmsparse option {key!r}{hint}; accepted: {', '.join(NM_OPTIONS)}, "
                "or any torch._inductor.config setting"
            )
        patches[key] = value
    if patches and inner != "inductor":
        raise ValueError(f"Inductor settings {sorted(patches)} need inner='inductor', not {inner!r}")
    return plan, inner, patches


def _compile_inner(gm: fx.GraphModule, example_inputs, inner: str, patches: dict):
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx, select_decomp_table

    decompositions = {**select_decomp_table(), **ops.DECOMPOSITIONS}
    return compile_fx(gm, example_inputs, config_patches=patches or None, decompositions=decompositions)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's graph module that passes may change freely."""
    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    for old, new in val_map.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    return copy


_UNSEEN = object()


class _Slot:
    """One sparsified weight: where its module arrives among the call arguments, and its recipe."""

    __slots__ = ("owner", "param_name", "fqn", "recipe", "dim", "buffer_names", "seen")

    def __init__(self, owner: int, target):
        self.owner = owner
        self.param_name, self.fqn = target.param_name, target.fqn
        self.recipe, self.dim = target.recipe, target.dim
        self.buffer_names = tuple(f"{target.param_name}_nm_{k}" for k in target.recipe.state_names)
        self.seen = _UNSEEN

    def state(self, module) -> tuple[torch.Tensor, ...]:
        ann = getattr(module._parameters[self.param_name], ATTR, None)
        if ann is not self.seen:
            self.seen = self._verify(module, ann)
        buffers = module._buffers
        return tuple(buffers[name] for name in self.buffer_names)

    def _verify(self, module, ann):
        if ann is None:  # first time this instance is seen (options / env / region route)
            return attach(module, self.param_name, self.recipe, self.dim)
        if ann.recipe != self.recipe or ann.dim != self.dim:
            raise RuntimeError(
                f"nmsparse: {self.fqn!r} was compiled with recipe {self.recipe} but is now annotated "
                f"with {ann.recipe}; call torch.compiler.reset() and compile the model again"
            )
        if any(name not in module._buffers for name in self.buffer_names):
            return attach(module, self.param_name, self.recipe, self.dim)
        return ann


class _CompiledNM:
    """Calls the compiled graph with each weight's recipe state appended to the inputs."""

    def __init__(self, compiled, n_inputs: int, slots: list[_Slot]):
        self.compiled, self.n_inputs, self.slots = compiled, n_inputs, slots

    def __call__(self, *args):
        n = self.n_inputs
        inputs, owners = list(args[:n]), args[n:]
        for slot in self.slots:
            inputs.extend(slot.state(owners[slot.owner]))
        return self.compiled(*inputs)


def _add_owner_inputs(gm: fx.GraphModule, sources) -> None:
    from torch._dynamo.variables.builder import GraphArg

    last = list(gm.graph.find_nodes(op="placeholder"))[-1]
    for i, source in enumerate(sources):
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"nm_owner_{i}")
        last.meta["grapharg"] = GraphArg(source, None, False, None, is_tensor=False)
    gm.recompile()


def _log(ctx: PassContext) -> None:
    for t in ctx.targets:
        log.info("nmsparse: %s <- %s (from %s)", t.fqn, t.recipe, t.origin)
    for name, reason in ctx.skipped.items():
        log.info("nmsparse: skipped %s: %s", name, reason)


def nmsparse_backend(gm: fx.GraphModule, example_inputs, *, options=None, mode=None, **kwargs):
    """Dynamo backend: insert the declared N:M recipes into the graph, then compile it."""
    plan, inner, patches = parse_options(options, mode)
    ctx = PassContext(options_plan=plan, env_plan=Plan.from_env())
    work = _copy(gm)
    run_passes(work, TRAIN_PASSES, ctx)
    _log(ctx)
    if not ctx.targets:
        return _compile_inner(work, list(example_inputs), inner, patches)
    owner_index: dict[str, int] = {}
    owners, slots, state_examples = [], [], []
    for target in ctx.targets:
        from ..passes._graph import source_name

        key = source_name(target.owner)
        if key not in owner_index:
            owner_index[key] = len(owners)
            owners.append(target.owner)
        slots.append(_Slot(owner_index[key], target))
        param = target.node.meta["grapharg"].example
        state = target.recipe.init_state(param.detach(), target.dim)
        state_examples.extend(state[k] for k in target.recipe.state_names)
    compiled = _compile_inner(work, [*example_inputs, *state_examples], inner, patches)
    _add_owner_inputs(gm, owners)
    return _CompiledNM(compiled, len(example_inputs), slots)
