"""Which kernel each training GEMM of every annotated weight runs, and why."""

from __future__ import annotations

from torch import nn

from ..state.records import annotation_of, owners

__all__ = ["train_report", "TrainReport"]

NOT_COMPILED = "not compiled yet"


class TrainReport(dict):
    """``{parameter name: kernels}``: per annotated weight, its forward, DGRAD (input gradient) and
    WGRAD (weight gradient) GEMM decisions (``.forward``, ``.dgrad``, ``.wgrad``, each with
    ``kernel``, ``reason`` and, where timed, ``speedup``), or :data:`NOT_COMPILED` before an
    ``nmsparse`` graph has run with the weight."""

    def __str__(self) -> str:
        lines = []
        for name, kernels in self.items():
            if isinstance(kernels, str):
                lines.append(f"{name}: {kernels}")
                continue
            lines.append(f"{name}:")
            lines.extend(f"  {role}: {decision}" for role, decision in kernels.as_dict().items())
        return "\n".join(lines) or "no annotated weights"


def train_report(model: nn.Module) -> TrainReport:
    """Per annotated weight of ``model``: the kernel of each training GEMM in the compiled graph that
    last ran it (the ``train_kernel`` backend option, decided per layer when compiling), and why."""
    report = TrainReport()
    for name, places in owners(model):
        _, module, pname = places[0]
        ann = annotation_of(module, pname)
        if ann is not None:
            report[name] = ann.kernels if ann.kernels is not None else NOT_COMPILED
    return report
