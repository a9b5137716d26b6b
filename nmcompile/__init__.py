"""nmcompile: N:M structured sparsity as a torch.compile pass.

Declare recipes as annotations (``annotate``, backend options, ``NMSPARSE_RECIPE``, ``region``),
then ``torch.compile(model, backend="nmsparse")``. Importing nmcompile imports no ONNX, TensorRT or
CUDA code.
"""

from . import ops as _ops  # registers the nmsparse:: custom ops
from . import recipes
from .annotate import AnnotationReport, annotate
from .diagnostics import diagnostics, plot_diagnostics
from .finalize import FinalizeReport, deploy_report, finalize
from .inspection import CheckReport, check, effective_weights
from .pattern import NMPattern
from .optimizer_hook import hook_optimizer
from .packed import Packed24, pack, pack_state_dict, unpack, unpack_state_dict
from .plan import Plan
from .recipes import parse as recipe
from .region import region
from .report import save_run

__all__ = [
    "annotate",
    "AnnotationReport",
    "check",
    "CheckReport",
    "diagnostics",
    "deploy_report",
    "export_onnx",
    "finalize",
    "FinalizeReport",
    "pack",
    "unpack",
    "pack_state_dict",
    "unpack_state_dict",
    "Packed24",
    "hook_optimizer",
    "plot_diagnostics",
    "save_run",
    "effective_weights",
    "NMPattern",
    "Plan",
    "recipe",
    "recipes",
    "region",
    "__version__",
]

__version__ = "0.1.0"


def export_onnx(model, args, path, **kwargs):
    """ONNX export of a finalized model, verified N:M and checked against onnxruntime.

    See :func:`nmcompile.backends.onnx.export_onnx` (imported on first use: ``onnx``,
    ``onnxscript`` and ``onnxruntime`` load only here).
    """
    from .backends.onnx import export_onnx as _export

    return _export(model, args, path, **kwargs)
