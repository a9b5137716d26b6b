"""nmcompile: N:M structured sparsity as a torch.compile pass.

Declare recipes as annotations (``annotate``, backend options, ``NMSPARSE_RECIPE``, ``region``),
then ``torch.compile(model, backend="nmsparse")``. Importing nmcompile imports no ONNX, TensorRT or
CUDA code.
"""

from . import ops as _ops  # registers the nmsparse:: custom ops
from . import recipes
from .annotate import AnnotationReport, annotate
from .diagnostics import diagnostics, plot_diagnostics
from .inspection import CheckReport, check, effective_weights
from .pattern import NMPattern
from .optimizer_hook import hook_optimizer
from .plan import Plan
from .recipes import parse as recipe
from .region import region

__all__ = [
    "annotate",
    "AnnotationReport",
    "check",
    "CheckReport",
    "diagnostics",
    "hook_optimizer",
    "plot_diagnostics",
    "effective_weights",
    "NMPattern",
    "Plan",
    "recipe",
    "recipes",
    "region",
    "__version__",
]

__version__ = "0.1.0"
