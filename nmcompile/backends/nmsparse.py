"""The ``nmsparse`` Dynamo backend (found through the ``torch_dynamo_backends`` entry point).

``torch.compile(model, backend="nmsparse", options={...})``:

1. copies Dynamo's graph and runs :data:`nmcompile.passes.TRAIN_PASSES` on the copy, which inserts
   each selected weight's recipe ops and adds recipe state as extra graph inputs, then reports
   what was declared and left dense (:mod:`nmcompile.backends.reconcile`);
2. compiles the copy with the inner compiler of :mod:`nmcompile.backends.inner` (Inductor with
   scoped ``config_patches``, or ``aot_eager``/``eager`` when ``options={"inner": ...}`` asks);
3. adds to Dynamo's graph one input per owning module (sourced like the weights), so every call
   receives the modules of the instance being run. The returned callable reads each weight's state
   from its module, or creates it the first time it meets an instance that was declared through
   options, ``NMSPARSE_RECIPE`` or a region. One compiled graph thus serves every instance of a
   model class, each with its own state.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch
from torch import fx

from ..declare.annotate import annotation_of, attach, state_of
from ..state.records import deployed_of, refresh_if_replaced
from ..passes import DEPLOY_PASSES, REWRITE_PASSES, TRAIN_PASSES, PassContext, run_passes
from ..passes.matching.sources import source_name
from ..declare.plan import Plan
from ..kernels.names import DEPLOY_CHOICES
from .inner import Inner, parse_options
from .reconcile import Holding, declare_plan, fresh_state_message, report, warn_if_mixed, warn_if_trained
from ..training.step_driver import driver
from .deploy_runner import DeployRunner, record_decisions

__all__ = ["nmsparse_backend"]




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


class _Slot:
    """One sparsified weight: where its module arrives among the call arguments, and its layout."""

    __slots__ = ("owner", "param_name", "fqn", "recipe", "dim", "origin")

    def __init__(self, owner: int, target):
        self.owner, self.param_name, self.fqn = owner, target.param_name, target.fqn
        self.recipe, self.dim = target.recipe, target.dim  # recipe: the one declared at compile time
        self.origin = target.origin  # the declaration route (annotate, region, options, NMSPARSE_RECIPE)

    def annotation(self, module, fresh: list):
        """The weight's annotation; attaches the compiled recipe (and appends to ``fresh``) the first time."""
        ann = annotation_of(module, self.param_name)
        if ann is None and deployed_of(module, self.param_name) is not None:
            raise RuntimeError(
                f"nmsparse: {self.fqn!r} was finalized after this model was compiled for training; compile the "
                "finalized model again (torch.compiler.reset(), then torch.compile(model, backend='nmsparse'))"
            )
        if ann is None:  # first time this instance is seen (options / env / region route)
            if self.recipe.prepares_model:
                warnings.warn(
                    f"nmsparse: {self.fqn!r} gets {self.recipe} without its model-level preparation "
                    f"(channel permutation), which only nmcompile.annotate(model, {str(self.recipe)!r}) "
                    "can run; its mask was computed on the weights as they are",
                    stacklevel=2,
                )
            if self.recipe.state_names:
                fresh.append(self)
            ann = attach(module, self.param_name, self.recipe, self.dim, self.fqn)
        ann.consumed = True
        return ann

    def state(self, module, ann) -> tuple[torch.Tensor, ...]:
        # a weight replaced after its state was computed; not in a process group, where FSDP2 swaps
        # the module's parameter objects around each forward (the step driver looks there instead)
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            refresh_if_replaced(module, self.param_name, ann, self.fqn)
        try:
            state = state_of(module, self.param_name, ann)
        except KeyError:  # state buffers were removed: recreate them from the weight
            state = state_of(module, self.param_name, attach(module, self.param_name, ann.recipe, self.dim))
        if ann.pending:
            raise RuntimeError(
                f"nmsparse: {self.fqn!r} ({ann.recipe}) is still on the meta device; its recipe state is computed "
                "from real weights. Call model.to_empty(device=...) and initialise the weights (or load a "
                "checkpoint) before the first forward"
            )
        return state


class _CompiledNM:
    """Calls the compiled graph with each weight's recipe state appended to the inputs.

    Instances of one model class share Dynamo's graph. When an instance's weights carry other
    recipes than the compiled ones, or a framed recipe's schedule reaches a new frame, a variant is
    compiled from the same graph and cached.
    """

    def __init__(self, base: fx.GraphModule, targets, slots, n_inputs: int, inner: Inner, train_kernel: str):
        self.base, self.targets, self.slots = base, targets, slots
        self.train_kernel = train_kernel
        # per variant, each target's training-GEMM kernels (kept in the weights' records, see __call__)
        self.kernels: dict[tuple, tuple] = {}
        self.current_kernels: tuple = ()
        self.driver = None  # the step driver, held while the graph has a recipe with a schedule
        self.watched: weakref.WeakSet = weakref.WeakSet()
        self.n_inputs, self.inner = n_inputs, inner
        self.variants: dict[tuple, object] = {}
        self.last = None
        self.compiled = None
        self.seen: dict[int, tuple] = {}  # id(weight) -> (weakref, weight version, clock version)
        # variants are compiled outside Dynamo, for the shapes of the call that needs them
        self.dynamic = any(
            _is_symbolic(node.meta.get("example_value")) for node in base.graph.find_nodes(op="placeholder")
        )

    @staticmethod
    def key(anns, frames) -> tuple:
        return tuple((ann.recipe, ann.dim) for ann in anns), frames

    def compile(self, anns, frames, example_inputs):
        key = self.key(anns, frames)
        compiled = self.variants.get(key)
        if compiled is None:
            compiled = self.variants[key] = self._compile_variant(anns, frames, example_inputs)
        self.last, self.compiled = (anns, frames), compiled
        self.current_kernels = self.kernels.get(key, ())
        return compiled

    def _compile_variant(self, anns, frames, example_inputs):
        work = _copy(self.base)
        nodes = {node.name: node for node in work.graph.find_nodes(op="placeholder")}
        targets = []
        for target, ann, frame in zip(self.targets, anns, frames):
            value = nodes[target.node.name].meta["example_value"]
            reason = ann.recipe.fits(value, ann.dim)
            if ann.dim != target.dim or reason is not None or self.dynamic:
                why = reason or ("the graph has dynamic shapes" if self.dynamic else "another layout")
                hint = (
                    "compile with torch.compile(..., dynamic=False) so that each schedule frame gets a static graph"
                    if self.dynamic and ann.recipe.framed
                    else "call torch.compiler.reset() and compile it again"
                )
                raise RuntimeError(
                    f"nmsparse: {target.fqn!r} was compiled with recipe {target.recipe} (frame {target.frame}) "
                    f"but this call needs {ann.recipe} (frame {frame}) ({why}); {hint}"
                )
            node = nodes[target.node.name]
            targets.append(dataclasses.replace(target, node=node, recipe=ann.recipe, frame=frame))
        ctx = PassContext(targets=targets, train_kernel=self.train_kernel, cuda_graphs=self.inner.cuda_graphs)
        ctx = run_passes(work, REWRITE_PASSES, ctx)
        self.kernels[self.key(anns, frames)] = tuple(ctx.train_kernels.get(t.fqn) for t in targets)
        key = repr(self.key(anns, frames))
        return self.inner.compile(work, list(example_inputs), key, ctx.extra_outputs)

    def _watch(self, owners, anns) -> None:
        """Have the step driver count optimizer steps for these modules' clocked weights."""
        if self.driver is None:
            self.driver = driver()
        for slot, ann in zip(self.slots, anns):
            if ann.recipe.clocked:
                self.driver.watch_module(owners[slot.owner], slot.param_name, slot.fqn)
        self.watched.update(owners)

    def _check_clock(self, slot, module, step) -> None:
        """Raise when the weight changed since the last call but its clock did not (no hook)."""
        param = module._parameters[slot.param_name]
        seen = self.seen.get(id(param))
        if (
            seen is not None and seen[0]() is param and param._version != seen[1]
            and step._version == seen[2] and module.training and torch.is_grad_enabled()
            and not (self.driver is not None and self.driver.updating(param))  # LBFGS: within one step
        ):
            raise RuntimeError(
                f"nmsparse: {slot.fqn!r} uses a recipe with a schedule on optimizer steps, and its weight "
                "was updated without a torch.optim.Optimizer step (nmcompile counts the steps of "
                "torch.optim optimizers through their global step hooks). Update it with a "
                "torch.optim.Optimizer, or advance the schedule yourself with "
                f"module.{slot.param_name}_nm_step += 1 after each update"
            )
        self.seen[id(param)] = (weakref.ref(param), param._version, step._version)

    def __call__(self, *args):
        n = self.n_inputs
        owners = args[n:]
        slots = self.slots
        fresh: list = []
        anns = tuple([slot.annotation(owners[slot.owner], fresh) for slot in slots])
        if fresh:
            warnings.warn(fresh_state_message(fresh), stacklevel=2)
        if any(ann.recipe.clocked for ann in anns) and any(m not in self.watched for m in owners):
            self._watch(owners, anns)
        inputs = list(args[:n])
        frames = []
        for slot, ann in zip(slots, anns):
            module = owners[slot.owner]
            state = slot.state(module, ann)
            inputs.extend(state)
            recipe = ann.recipe
            if recipe.clocked:
                step = state[recipe.state_names.index("step")]
                self._check_clock(slot, module, step)
                frames.append(recipe.frame_at(ann.clock.read(step)) if recipe.framed else None)
            else:
                frames.append(None)
        frames = tuple(frames)
        last = self.last
        if last is not None and last[1] == frames and last[0] == anns:
            compiled = self.compiled
        else:
            compiled = self.compile(anns, frames, inputs)
        for ann, kernels in zip(anns, self.current_kernels):  # train_report reads them from the records
            if ann.kernels is not kernels:
                ann.kernels = kernels
        return compiled(*inputs)


def _static(tensors: list) -> list:
    """Backend-made inputs as fake tensors of Dynamo's fake mode with static shapes.

    Otherwise AOTAutograd fakifies them with fresh size symbols that no Dynamo source backs, and a
    shape guard on one of them (e.g. a reshape of a tensor indexed by Bi-Mask's permutation) fails
    when Dynamo builds its guards.
    """
    context = torch._guards.TracingContext.try_get()
    if context is None or context.fake_mode is None:
        return tensors
    return [context.fake_mode.from_tensor(t, static_shapes=True) for t in tensors]


def _is_symbolic(value) -> bool:
    return isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape)


def _add_owner_inputs(gm: fx.GraphModule, sources) -> None:
    from torch._dynamo.variables.builder import GraphArg

    last = list(gm.graph.find_nodes(op="placeholder"))[-1]
    for i, source in enumerate(sources):
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"nm_owner_{i}")
        # not a tensor: Dynamo evaluates the module's source on every call and passes the module
        last.meta["grapharg"] = GraphArg(
            source=source, _example=None, pass_arg_as_tensor=False, fake_tensor=None, is_tensor=False
        )
    gm.recompile()


def nmsparse_backend(gm: fx.GraphModule, example_inputs, *, options=None, mode=None, **kwargs):
    """Dynamo backend: insert the declared N:M recipes into the graph, then compile it."""
    options = dict(options or {})
    deploy_kernel = options.pop("deploy_kernel", "auto")
    strict = options.pop("strict", False)
    if not isinstance(strict, bool):
        raise ValueError(f"nmsparse option strict={strict!r} must be True or False")
    if deploy_kernel not in DEPLOY_CHOICES:
        raise ValueError(f"nmsparse option deploy_kernel={deploy_kernel!r} is not one of {', '.join(DEPLOY_CHOICES)}")
    plan, inner, train_kernel = parse_options(options, mode)
    ctx = PassContext(
        options_plan=plan, env_plan=Plan.from_env(), deploy_kernel=deploy_kernel, train_kernel=train_kernel,
        cuda_graphs=inner.cuda_graphs,
    )
    work = _copy(gm)
    base = _copy(gm)
    run_passes(work, TRAIN_PASSES, ctx)
    report(ctx, strict)
    driver = declare_plan(work, ctx)
    if ctx.targets:
        warn_if_mixed(work, strict)
    else:
        run_passes(work, DEPLOY_PASSES, ctx)
        warn_if_trained(ctx, strict)
        if ctx.deployed:
            record_decisions(ctx)
            example = [*example_inputs, *_static([t for pair in ctx.compressed.values() for t in pair])]
            key = repr([(t.fqn, t.decision.graph_key) for t in ctx.deployed])
            return DeployRunner(work, ctx, inner.compile(work, example, key), len(example_inputs))
        compiled = inner.compile(work, list(example_inputs))
        return compiled if driver is None else Holding(compiled, driver)
    owner_index: dict[str, int] = {}
    owners, slots = [], []
    for target in ctx.targets:
        key = source_name(target.owner)
        if key not in owner_index:
            owner_index[key] = len(owners)
            owners.append(target.owner)
        slots.append(_Slot(owner_index[key], target))
    runner = _CompiledNM(base, ctx.targets, slots, len(example_inputs), inner, train_kernel)
    runner.driver = driver or runner.driver
    # the declared recipes are the first variant; example state comes from these weights
    state = []
    for t in ctx.targets:
        values = t.recipe.example_state(t.node.meta["grapharg"].example.detach(), t.dim)
        state.extend(values[key] for key in t.recipe.state_names)
    state = _static(state)
    key = (tuple((t.recipe, t.dim) for t in ctx.targets), tuple(t.frame for t in ctx.targets))
    runner.kernels[key] = tuple(ctx.train_kernels.get(t.fqn) for t in ctx.targets)
    runner.variants[key] = inner.compile(work, [*example_inputs, *state], repr(key), ctx.extra_outputs)
    _add_owner_inputs(gm, owners)
    return runner
