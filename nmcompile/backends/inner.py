"""The backend's options, and how it compiles a rewritten graph (the inner compiler).

Options (``torch.compile(model, backend="nmsparse", options={...})``):

- ``recipe``, ``include``, ``exclude``: a plan for every weight the pattern selects;
- ``inner``: ``"inductor"`` (default), or ``"aot_eager"``/``"eager"`` for debugging; where the options name no
  inner compiler and set nothing only Inductor reads (``projections``, ``mode``, Inductor settings), the
  environment variable ``NMSPARSE_INNER`` names it (an existing script debugged under ``aot_eager`` unedited;
  the test suite's default);
- ``projections``: how Inductor builds the recipes' mask ops (:mod:`nmcompile.backends.shared_projections`):
  ``"inline"`` fuses each weight's projection into the graph (every weight code-generated on its
  own, about a second of compile per sparsified weight on a CPU); ``"shared"`` calls one kernel per
  distinct weight signature, compiled once; ``"auto"`` (default) shares the projections whose
  signature at least three weights of the graph have (``shared_kernels.MIN_REPEATS``), on a CPU and
  without Inductor settings, and inlines the rest (the shared kernels are compiled with Inductor's
  default settings, and their per-call cost on a GPU has not been measured);
- ``train_kernel``: which kernels the training GEMMs whose operands a 2:4 recipe makes 2:4 use
  (:mod:`nmcompile.kernels.dispatch.train`): ``"auto"`` (default: cuSPARSELt where it can run and
  was timed faster, else dense), ``"dense"``, ``"cusparselt"``, ``"cutlass"`` (an error where they
  cannot run), ``"reference"`` (the packed layout and a dense product, any device);
- ``mode``: a ``torch.compile`` mode (``"reduce-overhead"`` for CUDA graphs, ``"max-autotune"``...),
  for when other options are given too (``torch.compile`` refuses ``mode=`` beside ``options=``);
- ``deploy_kernel``, ``strict`` (read by the backend itself; ``strict=True`` turns the summary of
  declared weights left dense into an error);
- any ``torch._inductor.config`` setting, passed to Inductor as scoped ``config_patches``.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field

import torch
from torch import fx

from ..declare.plan import Plan
from ..recipes.base import nearest
from .shared_projections import repeated_signatures
from .inductor_cache import Decompositions, with_cache_key
from ..kernels.names import TRAIN_CHOICES

__all__ = ["Inner", "parse_options", "NM_OPTIONS", "INNER", "PROJECTIONS"]

NM_OPTIONS = ("recipe", "include", "exclude", "default_dense", "inner", "projections", "train_kernel", "deploy_kernel",
              "strict", "mode")
INNER = ("inductor", "aot_eager", "eager")
INNER_ENV = "NMSPARSE_INNER"  # the inner compiler where the options name none
PROJECTIONS = ("auto", "inline", "shared")


def _inductor_keys() -> set[str]:
    import torch._inductor.config as inductor_config

    return set(inductor_config._config)


@dataclass(frozen=True)
class Inner:
    """The inner compiler: its name, the user's Inductor settings and the projections choice."""

    name: str = "inductor"
    patches: dict = field(default_factory=dict)
    projections: str = "auto"

    @property
    def cuda_graphs(self) -> bool:
        """Whether Inductor runs the graph under CUDA graphs (``mode="reduce-overhead"``), where the
        kernels' host work is not paid per call: the kernel decisions then time GPU work alone."""
        return self.name == "inductor" and bool(self.patches.get("triton.cudagraphs", False))

    def shared_projections(self, gm: fx.GraphModule, example_inputs) -> str | tuple | None:
        """Which projections call a shared kernel: ``"all"``, a tuple of their signatures, or None."""
        if self.name != "inductor" or self.projections == "inline":
            return None
        if self.projections == "shared":
            return "all"
        on_cpu = all(t.device.type == "cpu" for t in example_inputs if isinstance(t, torch.Tensor))
        if not on_cpu or self.patches:
            return None

        repeated = repeated_signatures(gm)
        return tuple(sorted(repeated, key=repr)) if repeated else None

    def compile(self, gm: fx.GraphModule, example_inputs, plan_key: str = "", extra_outputs: int = 0):
        """``gm`` compiled; its last ``extra_outputs`` outputs (added by the passes) are dropped."""
        if self.name == "eager":
            compiled = gm.forward
        elif self.name == "aot_eager":
            compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        else:
            from torch._inductor.compile_fx import compile_fx


            share = self.shared_projections(gm, example_inputs)
            decompositions = Decompositions(share)
            # in the cache key: "auto" shares the signatures it found
            patches = with_cache_key(self.patches, f"{plan_key}\nshared projections: {share}")
            compiled = compile_fx(gm, example_inputs, config_patches=patches, decompositions=decompositions)
        if not extra_outputs:
            return compiled

        def without_extra_outputs(*args):
            return compiled(*args)[:-extra_outputs]

        return without_extra_outputs


def parse_options(options, mode) -> tuple[Plan | None, Inner, str]:
    """``(plan or None, inner compiler, train_kernel)`` from the backend options (without ``deploy_kernel``)."""
    options = dict(options or {})
    train_kernel = options.pop("train_kernel", "auto")
    if train_kernel not in TRAIN_CHOICES:
        raise ValueError(
            f"nmsparse option train_kernel={train_kernel!r} is not one of {', '.join(TRAIN_CHOICES)}"
            f"{nearest(str(train_kernel), TRAIN_CHOICES)}"
        )
    recipe = options.pop("recipe", None)
    include, exclude = options.pop("include", None), options.pop("exclude", None)
    default_dense = options.pop("default_dense", None)
    # the environment's inner compiler applies where the options name none and ask nothing of Inductor
    inductor_only = {"projections", "mode"} | (set(options) - set(NM_OPTIONS))
    from_env = "inner" not in options and not inductor_only & set(options) and mode in (None, "default")
    name = options.pop("inner", None) or (os.environ.get(INNER_ENV) if from_env else None) or "inductor"
    if name not in INNER:
        origin = f"${INNER_ENV}" if from_env and os.environ.get(INNER_ENV) else "option inner"
        raise ValueError(f"nmsparse {origin}={name!r} is not one of {', '.join(INNER)}")
    projections = options.pop("projections", "auto")
    if projections not in PROJECTIONS:
        raise ValueError(f"nmsparse option projections={projections!r} is not one of {', '.join(PROJECTIONS)}")
    if recipe is None and (include or exclude or default_dense is not None):
        raise ValueError("nmsparse options include/exclude/default_dense need a 'recipe' to filter")
    plan = Plan.build(recipe, include=include, exclude=exclude, default_dense=default_dense) if recipe is not None else None
    if "mode" in options:
        if mode is not None:
            raise ValueError("nmsparse: give the mode once, as torch.compile(mode=...) or as options={'mode': ...}")
        mode = options.pop("mode")
        modes = torch._inductor.list_mode_options()
        if mode not in modes:
            raise ValueError(f"nmsparse option mode={mode!r} is not one of {', '.join(modes)}")
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
    if patches and name != "inductor":
        raise ValueError(f"Inductor settings {sorted(patches)} need inner='inductor', not {name!r}")
    return plan, Inner(name, patches, projections), train_kernel
