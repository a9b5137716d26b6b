"""N:M compliance reports: which tensors keep at most N of every M along their grouping dim.

Filled by :func:`nmcompile.check` for models and state dicts, and by the ONNX checker for files.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import masks
from ..pattern import NMPattern

__all__ = ["WeightCheck", "CheckReport", "check_one", "selects"]


@dataclass(frozen=True)
class WeightCheck:
    pattern: NMPattern
    dim: int
    groups: int
    violations: int  # groups with more than N non-zeros
    problem: str = ""  # what is wrong with the recipe state behind the weight, or the entry of a packed dict

    @property
    def ok(self) -> bool:
        return self.violations == 0 and not self.problem


class CheckReport(dict):
    """``{tensor name: WeightCheck}``; ``skipped`` maps names that were not checked to why.

    ``ok`` holds when at least one tensor was checked and every checked tensor complies: a report
    that checked nothing is not ok. ``where`` is the place in a checkpoint dict the state dict was
    found at (``"['model']"``), or ``""``. ``only``: the name patterns the check was limited to
    (``check(..., only=...)``); ``unselected`` counts the tensors they left out.
    """

    def __init__(self):
        super().__init__()
        self.skipped: dict[str, str] = {}
        self.where = ""
        self.only: tuple[str, ...] = ()
        self.unselected = 0
        #: for a failed check of a file without a layout record: a --dim and --only that fit it (or "")
        self.hint = ""

    @property
    def ok(self) -> bool:
        return len(self) > 0 and all(c.ok for c in self.values())

    def __str__(self) -> str:
        where = f" of checkpoint{self.where}" if self.where else ""
        if not self:
            lines = [f"N:M check{where}: no tensor was checked, so none is shown to comply (not ok)"]
        else:
            lines = [f"N:M check{where}: {sum(c.ok for c in self.values())}/{len(self)} tensors comply"]
        for name, c in self.items():
            status = "ok" if c.ok else f"{c.violations}/{c.groups} groups violate"
            if c.problem:
                status = f"{c.violations}/{c.groups} groups violate; {c.problem}"
            lines.append(f"  {name}: {c.pattern} along dim {c.dim}: {status}")
        lines += [f"  - {name}: not checked ({why})" for name, why in self.skipped.items()]
        if self.only:
            lines.append(f"  ({self.unselected} other tensors not checked: only {', '.join(self.only)} was asked for)")
        return "\n".join(lines)


def selects(report: CheckReport, name: str, only: Sequence[str] | str | None) -> bool:
    """Whether ``name`` matches one of the glob patterns ``only`` (None: every name); a name left
    out is counted in ``report.unselected``."""
    if only is None:
        return True
    only = (only,) if isinstance(only, str) else tuple(only)
    report.only = only
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in only):
        return True
    report.unselected += 1
    return False


def check_one(report: CheckReport, name: str, tensor: torch.Tensor, pattern: NMPattern, dim: int,
              problem: str = "") -> None:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(
            f"check: dim={dim} does not exist in {name!r} of shape {tuple(tensor.shape)}; dim is the grouping "
            f"dimension, from {-tensor.dim()} to {tensor.dim() - 1} (1 for Linear/Conv, 0 for GPT-2 Conv1D)"
        )
    reason = pattern.fits(tensor, dim)
    if reason is not None:
        report.skipped[name] = reason
        return
    bad, total = masks.count_violations(tensor, pattern.n, pattern.m, dim)
    report[name] = WeightCheck(pattern, dim, total, bad, problem)
