"""Plots of a recorded run: ``run.json`` from ``nmcompile demo``, or from a user's own training loop
through :func:`save_run`.

:func:`write_report` writes into the run's folder:

- ``loss.png``: training loss and the evaluation metric over optimizer steps, with STEP's switch
  step marked where there is one, and the dense model's curves as a reference where the record
  holds them (``save_run(..., dense_loss=..., dense_eval=...)``: a dense run already made, so that
  the plot shows what N:M cost);
- ``masks.png``: per-layer mask flip rate and SAD (and STEP's Z_t), from the run's diagnostics;
- ``sparsity.png``: the fraction of zeros in each layer's forward weight at the end.
"""

from __future__ import annotations

import json
import os

import torch

from ..training.diagnostics import diagnostics, plot_diagnostics, series_style
from ..deploy.inspection import effective_records

__all__ = ["write_report", "load_run", "save_run", "model_record"]


def model_record(model) -> dict:
    """The model's part of a run record: each annotated weight's recipe, diagnostics series and
    final sparsity (fraction of zeros in the forward weight)."""
    recipes, sparsity = {}, {}
    for name, ann, weight in effective_records(model):
        recipes[name] = str(ann.recipe)
        sparsity[name] = float((weight == 0).float().mean())
    series = {name: {key: value.tolist() for key, value in entry.items()} for name, entry in diagnostics(model).items()}
    return {"recipes": recipes, "diagnostics": series, "sparsity": sparsity}


def _points(name: str, values, where: str = "save_run") -> list[tuple[int, float]]:
    out = []
    try:
        items = list(values)
    except TypeError as err:
        raise ValueError(f"{where}: {name} must be a list of (optimizer step, value) pairs, got {values!r}") from err
    for item in items:
        try:
            step, value = item
            out.append((int(step), float(value)))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {name} must be (optimizer step, value) pairs, got {item!r}") from err
    return out


def save_run(run_dir, model, *, loss=(), eval=(), eval_name: str = "evaluation", recipe: str | None = None,
             dense_loss=(), dense_eval=()) -> str:
    """Write ``run_dir/run.json`` from a user's own training loop, for ``nmcompile report RUN_DIR``.

    ``loss`` and ``eval`` are ``(optimizer step, value)`` pairs; the diagnostics (recorded by
    :func:`nmcompile.hook_optimizer` with ``diagnostics_every``), the final per-layer sparsity and
    STEP's switch come from ``model``. ``recipe`` labels the plots (default: the recipes found).
    ``dense_loss`` and ``dense_eval``: the same series of the dense model, where one was trained
    (nothing is trained here), drawn as the reference line. Returns the file's path.
    """
    record = {"loss": _points("loss", loss), "eval": _points("eval", eval), "eval_name": eval_name,
              "dense_loss": _points("dense_loss", dense_loss), "dense_eval": _points("dense_eval", dense_eval)}
    record.update(model_record(model))
    if not record["recipes"]:
        raise ValueError("save_run: the model has no annotated weights (annotate it, or compile it with a recipe, first)")
    record["recipe"] = recipe or ", ".join(sorted(set(record["recipes"].values())))
    record["steps_run"] = max((step for step, _ in record["loss"] + record["eval"]), default=0)
    run_dir = os.fspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "run.json")
    with open(path, "w") as handle:
        json.dump(record, handle)
    return path


def load_run(run_dir) -> dict:
    """``run_dir/run.json`` with its entries checked: ValueError names what a malformed file lacks."""
    path = os.path.join(os.fspath(run_dir), "run.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} does not exist; RUN_DIR must be a folder written by 'nmcompile demo --out RUN_DIR' "
            "or by nmcompile.app.report.save_run(RUN_DIR, model, loss=...) from your own training loop"
        )
    with open(path) as handle:
        try:
            run = json.load(handle)
        except ValueError as err:
            raise ValueError(f"{path}: not a run record: not valid JSON ({err})") from err
    return _checked_run(run, path)


_SERIES = ("flip_rate", "sad", "z")


def _checked_run(run, path: str) -> dict:
    """``run`` with its series as (step, value) pairs, or ValueError naming what does not fit."""
    fix = "run.json is written by 'nmcompile demo' or nmcompile.app.report.save_run; rewrite it with save_run"
    if not isinstance(run, dict):
        raise ValueError(f"{path}: not a run record: expected a JSON object, got {type(run).__name__}; {fix}")
    if "loss" not in run:
        raise ValueError(f"{path}: not a run record: it has no 'loss' entry; {fix}")
    run = dict(run)
    for key in ("loss", "eval", "dense_loss", "dense_eval"):
        run[key] = _points(key, run.get(key, []), path)
    for key in ("recipe", "eval_name"):
        if key in run and not isinstance(run[key], str):
            raise ValueError(f"{path}: {key} must be a string, got {run[key]!r}; {fix}")
    diag = run.get("diagnostics", {})
    if not isinstance(diag, dict) or not all(isinstance(entry, dict) for entry in diag.values()):
        raise ValueError(f"{path}: diagnostics must map each weight to an object of series; {fix}")
    for name, entry in diag.items():
        for key, value in entry.items():
            try:
                torch.tensor(value, dtype=torch.float64)
            except (TypeError, ValueError, RuntimeError) as err:
                raise ValueError(f"{path}: diagnostics[{name!r}][{key!r}] must be numbers, got {value!r}; {fix}") from err
        switch = entry.get("switch_step", -1)
        if isinstance(switch, bool) or not isinstance(switch, int):
            raise ValueError(f"{path}: diagnostics[{name!r}]['switch_step'] must be an optimizer step, got {switch!r}; {fix}")
        for key in _SERIES:
            steps = entry.get(f"{key}_steps")
            if key in entry and (not isinstance(entry[key], list) or not isinstance(steps, list) or len(steps) != len(entry[key])):
                raise ValueError(
                    f"{path}: diagnostics[{name!r}][{key!r}] needs a list {key}_steps of the same length; {fix}"
                )
    sparsity = run.get("sparsity", {})
    if not isinstance(sparsity, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in sparsity.values()
    ):
        raise ValueError(f"{path}: sparsity must map each weight to a fraction of zeros, got {sparsity!r}; {fix}")
    return run


def _figure(rows: int, height: float = 2.8):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("nmcompile report needs matplotlib: pip install 'nmcompile[plot]'") from err
    fig = Figure(figsize=(7, height * rows), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, 1, squeeze=False)[:, 0]


def _switch_steps(run: dict) -> list[int]:
    steps = {int(entry["switch_step"]) for entry in run.get("diagnostics", {}).values() if "switch_step" in entry}
    return sorted(s for s in steps if s >= 0)


def _loss_figure(run: dict):
    """The loss and evaluation plots of a checked run record (see :func:`load_run`)."""
    fig, (loss_ax, eval_ax) = _figure(2)
    recipe = run.get("recipe", "recipe not recorded")
    dense = bool(run["dense_loss"] or run["dense_eval"])
    for ax, key in ((loss_ax, "loss"), (eval_ax, "eval")):
        if run[key]:
            steps, values = zip(*run[key])
            ax.plot(steps, values, linewidth=1, label=recipe, **series_style(len(values)))
        if run[f"dense_{key}"]:
            steps, values = zip(*run[f"dense_{key}"])
            ax.plot(steps, values, color="0.45", linewidth=1, linestyle=":", label="dense", **series_style(len(values)))
    reference = "" if dense else "; no dense reference recorded (save_run(..., dense_loss=...))"
    loss_ax.set_title(f"training loss ({recipe}){reference}", fontsize=9)
    eval_ax.set_title(run.get("eval_name", "evaluation"), fontsize=9)
    loss_ax.set_ylabel("training loss", fontsize=8)
    eval_ax.set_ylabel(run.get("eval_name", "evaluation").split(" (")[0], fontsize=8)
    for ax in (loss_ax, eval_ax):
        for switch in _switch_steps(run):
            ax.axvline(switch, color="k", linestyle="--", linewidth=0.8, label="STEP switch")
        ax.set_xlabel("optimizer step", fontsize=8)
        if dense and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report(run_dir) -> list[str]:
    """Write the run's plots as PNG files in ``run_dir``; returns their paths."""
    run = load_run(run_dir)
    run_dir = os.fspath(run_dir)
    paths = []
    fig = _loss_figure(run)
    paths.append(os.path.join(run_dir, "loss.png"))
    fig.savefig(paths[-1], format="png")

    diag = {
        name: {key: torch.tensor(value) for key, value in entry.items()}
        for name, entry in run.get("diagnostics", {}).items()
    }
    if diag:
        paths.append(plot_diagnostics(diag, os.path.join(run_dir, "masks.png")))
    sparsity = run.get("sparsity", {})
    if sparsity:
        fig, (ax,) = _figure(1, height=0.35 * len(sparsity) + 1.2)
        names = list(sparsity)
        ax.barh(range(len(names)), [sparsity[n] for n in names])
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xlim(0, 1)
        ax.set_xlabel("fraction of zeros in the forward weight", fontsize=8)
        ax.set_ylabel("weight", fontsize=8)
        ax.set_title("per-layer sparsity at the end of training", fontsize=9)
        fig.tight_layout()
        paths.append(os.path.join(run_dir, "sparsity.png"))
        fig.savefig(paths[-1], format="png")
    return paths
