"""Mask dynamics recorded while training: flip rate, SAD, and STEP's Z_t and switch step.

:func:`nmcompile.hook_optimizer` records, every ``diagnostics_every`` optimizer steps and for every
annotated weight, the mask the forward applies and compares it with the previous record and the
first one. Values stay device tensors until read (no sync while training):

- ``flip_rate``: the fraction of mask positions that changed since the previous record;
- ``sad``: the number of positions that differ from the first recorded mask (sparse architecture
  divergence);
- for STEP: ``z`` (the second-moment change Z_t of each phase-1 step) and ``switch_step``.

:func:`diagnostics` returns them per weight; :func:`plot_diagnostics` draws them into a PNG.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from ..state.records import annotation_of, owners, state_dict_of

__all__ = ["diagnostics", "plot_diagnostics"]


def diagnostics(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{weight name: {series: tensor}}`` recorded so far by :func:`nmcompile.hook_optimizer`.

    Series: ``flip_rate`` and ``sad`` (with ``flip_rate_steps``/``sad_steps``, the optimizer steps
    they were taken at); STEP weights add ``z``/``z_steps`` and ``switch_step`` (-1 before the
    switch). Weights with nothing recorded yet map to an empty dict.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, places in owners(model):
        _, module, pname = places[0]
        ann = annotation_of(module, pname)
        if ann is None:
            continue
        entry = ann.trace.read()
        state = state_dict_of(module, pname, ann) if all(
            b in module._buffers for b in ann.buffer_names(pname)
        ) else {}
        if "switch_step" in state:
            entry["switch_step"] = state["switch_step"].detach().cpu()
        out[name] = entry
    return out


#: a series with at most this many points is drawn with a marker on each, so that a single point shows
MARKED_POINTS = 30


def series_style(points: int) -> dict:
    """Line style of a plotted series: markers where it is short (one point is invisible as a bare line)."""
    return {"marker": "o", "markersize": 3} if points <= MARKED_POINTS else {}


def diagnostics_figure(diag: dict[str, dict[str, torch.Tensor]]):
    """The matplotlib figure of :func:`diagnostics` output: flip rate, SAD, and Z_t when present."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "plot_diagnostics needs matplotlib: pip install 'nmcompile[plot]' (or pip install matplotlib)"
        ) from err
    panels = [("flip_rate", "flip rate (since the previous record)", "fraction of positions"),
              ("sad", "SAD (positions changed since the first record)", "positions")]
    if any("z" in entry for entry in diag.values()):
        panels.append(("z", "STEP Z_t (second-moment change)", "Z_t"))
    fig = Figure(figsize=(7, 2.6 * len(panels)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (key, title, ylabel) in zip(axes, panels):
        for name, entry in diag.items():
            if key in entry and entry[key].numel():
                values = entry[key].numpy()
                ax.plot(entry[f"{key}_steps"].numpy(), values, label=name, linewidth=1, **series_style(len(values)))
            switch = entry.get("switch_step")
            if key == "z" and switch is not None and int(switch) >= 0:
                ax.axvline(int(switch), color="k", linestyle="--", linewidth=0.8)
        ax.set_title(title, fontsize=9)
        if key == "z":
            ax.set_yscale("log")
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def plot_diagnostics(diag: dict[str, dict[str, torch.Tensor]], path: str | os.PathLike) -> str:
    """Draw :func:`diagnostics` output (flip rate, SAD, and Z_t when present) into a PNG at ``path``."""
    diagnostics_figure(diag).savefig(os.fspath(path), format="png")
    return os.fspath(path)
