"""Training time: the optimizer-step driver that runs recipe schedules, and mask diagnostics.

:mod:`.step_driver` holds PyTorch's global optimizer step hooks while a declared model lives
(schedules need no call; :mod:`.step_closures` and :mod:`.step_checks` are its closure handling and
its per-step checks); :func:`hook_optimizer` (:mod:`.optimizer_hook`) adds diagnostics and ``check_finite``.
:mod:`.diagnostics` reads what was recorded (:func:`diagnostics`) and plots it (:func:`plot_diagnostics`).
:func:`train_report` says which kernel each training GEMM of every annotated weight runs, and why.
"""

from .diagnostics import diagnostics, plot_diagnostics
from .optimizer_hook import hook_optimizer
from .report import train_report

__all__ = ["hook_optimizer", "diagnostics", "plot_diagnostics", "train_report"]
