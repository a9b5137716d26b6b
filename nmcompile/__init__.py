"""nmcompile: N:M structured sparsity as a torch.compile pass.

Declare recipes as annotations (``annotate``, backend options, ``NMSPARSE_RECIPE``, ``region``),
then ``torch.compile(model, backend="nmsparse")``. The everyday verbs are here; the rest lives in
its stage's module (``nmcompile.declare``, ``nmcompile.training``, ``nmcompile.deploy``,
``nmcompile.app``; see docs/architecture.md). Importing nmcompile imports no ONNX, TensorRT or
CUDA code, and not the demo application.
"""

from . import ops as _ops  # registers the nmsparse:: custom ops
from . import recipes
from .declare import annotate, region
from .deploy import check, deploy_report, effective_weights, export_onnx, finalize, pack, unpack
from .recipes import parse as recipe
from .training import diagnostics, hook_optimizer
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


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"nmcompile.{name} is not a top-level name; import it from {_MOVED[name]} "
                             f"(from {_MOVED[name]} import {name})")
    raise AttributeError(f"module 'nmcompile' has no attribute {name!r}")
