"""What a finalized weight is recorded as (:class:`Deployed`, kept in the owning module's records,
:mod:`nmcompile.state.records`), and what :func:`nmcompile.finalize` reports (:class:`FinalizeReport`).

Written by finalize, restore and the packed loaders; read by the checks, the savers and the deploy passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..pattern import NMPattern

__all__ = ["Deployed", "FinalizeReport"]


@dataclass(frozen=True)
class Deployed:
    """A finalized weight: N:M along ``dim``, trained with ``recipe``.

    ``recipe`` is ``""`` for a weight recorded by ``finalize(model, pattern=...)`` from a loaded
    checkpoint. The owning module keeps the record under the parameter's name, so it stays through
    ``load_state_dict(assign=True)``, ``copy.deepcopy`` and anything else that replaces the parameter.
    """

    pattern: NMPattern
    dim: int
    recipe: str
    change: float = 0.0  # relative L2 change of the forward weight that finalize(force=True) made
    # why the compiled graph left the declared weight dense (it trained dense; finalize(force=True) pruned it)
    trained_dense: str = ""

    def describe(self) -> str:
        how = f"trained with {self.recipe}" if self.recipe else "loaded N:M"
        if self.trained_dense:
            how = f"trained dense, pruned by magnitude at finalize: {self.trained_dense}"
        changed = f", changed by {self.change:.3g} (forced)" if self.change else ""
        return f"{self.pattern} along dim {self.dim} ({how}){changed}"


class FinalizeReport(dict):
    """``{parameter name: Deployed}`` of every finalized weight; ``dense``: ``{name: why}`` of the
    weights ``finalize(model, pattern=...)`` looked at and left dense."""

    def __init__(self) -> None:
        super().__init__()
        self.dense: dict[str, str] = {}
        #: one-shot recipes (Wanda, SparseGPT): ``{name: [what was done instead of the normal solve]}``
        self.fallbacks: dict[str, list[str]] = {}
        #: one-shot recipes: how they were calibrated (one pass or sequential) and why
        self.calibration = ""

    def __str__(self) -> str:
        lines = [f"nmcompile.finalize: {len(self)} weights are N:M"]
        lines += [f"  {name}: {d.describe()}" for name, d in self.items()]
        lines += [f"  - {name}: dense, {why}" for name, why in self.dense.items()]
        lines += [f"  ! {note}" for notes in self.fallbacks.values() for note in notes]
        return "\n".join(lines)
