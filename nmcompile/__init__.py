"""nmcompile: N:M structured sparsity as a torch.compile pass.

Declare recipes as annotations (``annotate``, backend options, ``NMSPARSE_RECIPE``, ``region``),
then ``torch.compile(model, backend="nmsparse")``. The everyday verbs are here; the rest lives in
its stage's module (``nmcompile.declare``, ``nmcompile.training``, ``nmcompile.deploy``,
``nmcompile.app``; see docs/architecture.md). Importing nmcompile imports no ONNX, TensorRT or
CUDA code, and not the demo application; it imports not even torch until a name is first used (the
``nmcompile`` command's ``--help`` needs none).
"""

import importlib as _importlib
import importlib.util as _importlib_util

from .version import __version__

__all__ = [
    # declare
    "annotate",
    "region",
    "recipe",
    "recipes",
    # train
    "effective_weights",
    "hook_optimizer",
    "diagnostics",
    # deploy
    "finalize",
    "deploy_report",
    "check",
    "export_onnx",
    "pack",
    "unpack",
    "__version__",
]

# Names that left the top level, and where they live now: a clear error instead of a bare AttributeError.
_MOVED = {
    "AnnotationReport": "nmcompile.declare",
    "Plan": "nmcompile.declare",
    "FinalizeReport": "nmcompile.deploy",
    "CheckReport": "nmcompile.deploy",
    "Packed24": "nmcompile.deploy",
    "pack_state_dict": "nmcompile.deploy",
    "unpack_state_dict": "nmcompile.deploy",
    "plot_diagnostics": "nmcompile.training",
    "train_report": "nmcompile.training",
    "save_run": "nmcompile.app",
    "NMPattern": "nmcompile.pattern",
}



_loaded = False


def _load() -> None:
    """Import the everyday verbs (and so torch, and the ``nmsparse::`` custom ops) at their first use.

    ``import nmcompile`` itself stays light, so that the ``nmcompile`` command answers ``--help``
    without importing torch; the first name asked for loads them all, as an eager import would."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    _importlib.import_module(f"{__name__}.ops")  # registers the nmsparse:: custom ops
    recipes = _importlib.import_module(f"{__name__}.recipes")
    from .declare import annotate, region
    from .deploy import check, deploy_report, effective_weights, export_onnx, finalize, pack, unpack
    from .recipes import parse as recipe
    from .training import diagnostics, hook_optimizer

    globals().update(annotate=annotate, region=region, recipe=recipe, recipes=recipes,
                     effective_weights=effective_weights, hook_optimizer=hook_optimizer, diagnostics=diagnostics,
                     finalize=finalize, deploy_report=deploy_report, check=check, export_onnx=export_onnx,
                     pack=pack, unpack=unpack)


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"nmcompile.{name} is not a top-level name; import it from {_MOVED[name]} "
                             f"(from {_MOVED[name]} import {name})")
    if not name.startswith("_") and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
        # a stage read as an attribute (nmcompile.masks, nmcompile.recipes), also by the stages themselves
        # (from .. import masks) while the verbs may be half loaded: the module alone
        return _importlib.import_module(f"{__name__}.{name}")
    if name in __all__:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'nmcompile' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
