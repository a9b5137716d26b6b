"""The ``oneshot`` regime's section of docs/quality.md: per method and pattern the dense start, the
one-shot loss, the loss after 100 and 600 fine-tune steps and the calibration + solve seconds (3-seed
means ± std), and the verdicts on the papers' claims (SparseGPT, Wanda far better than magnitude at
2:4; Wanda close to SparseGPT; a short fine-tune closes the gap; sequential vs one-pass calibration).

Yardsticks, stated in the section: "far better" means the one-shot loss increase over dense is at
most half of magnitude's, in every seed; "close" means the Wanda-SparseGPT difference is under a
quarter of the magnitude-SparseGPT difference; a gap is "closed" when the methods' means after the
fine-tune lie within the larger seed std of each other.
"""

from __future__ import annotations

import statistics

METHODS = ("magnitude", "wanda", "sparsegpt", "sparsegpt_seq")
PATTERNS = ("2:4", "4:8", "1:4")
FIELDS = ("start_eval", "oneshot_eval", "eval_100", "eval_600", "calib_seconds")
TRAINED = [("long", "dense"), ("long", "sr_ste 2:4"), ("long", "s_ste 2:4"), ("long", "step 2:4"),
           ("finetune", "asp 2:4"), ("finetune", "dense")]


def _ms(values):
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


def oneshot_summary(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """``{(method, pattern): {field: (mean, std), "n": seeds, "by_seed": {seed: row}}}``."""
    out = {}
    for row in rows:
        if row.get("regime") == "oneshot":
            method, pattern = row["name"].split(" ")
            out.setdefault((method, pattern), {"by_seed": {}})["by_seed"][row["seed"]] = row
    for entry in out.values():
        runs = list(entry["by_seed"].values())
        entry["n"] = len(runs)
        entry.update({f: _ms([r[f] for r in runs]) for f in FIELDS})
    return out


def _cell(entry, field, digits=4):
    mean, std = entry[field]
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _paired(a, b, field):
    """Seeds where ``a`` has the lower ``field`` than ``b``, of the seeds both ran."""
    seeds = sorted(set(a["by_seed"]) & set(b["by_seed"]))
    return sum(a["by_seed"][s][field] < b["by_seed"][s][field] for s in seeds), len(seeds)


def _verdicts(summary, pattern: str) -> list[str]:
    get = {m: summary.get((m, pattern)) for m in METHODS}
    out = []
    mag, wanda, sgpt, seq = (get[m] for m in METHODS)
    if mag and wanda and sgpt:
        dense = mag["start_eval"][0]
        rise = {m: get[m]["oneshot_eval"][0] - dense for m in ("magnitude", "wanda", "sparsegpt")}
        for m in ("wanda", "sparsegpt"):
            seeds = sorted(set(get[m]["by_seed"]) & set(mag["by_seed"]))
            per_seed = [(get[m]["by_seed"][s]["oneshot_eval"] - get[m]["by_seed"][s]["start_eval"],
                         mag["by_seed"][s]["oneshot_eval"] - mag["by_seed"][s]["start_eval"]) for s in seeds]
            far = all(r <= h / 2 for r, h in per_seed)
            better = all(r < h for r, h in per_seed)
            verdict = "holds" if far else ("better, but not far better" if better else "does not hold")
            out.append(f"- {m} far better than magnitude ({pattern}, one-shot): **{verdict}** ({len(seeds)} seeds): "
                       f"loss over dense {rise[m]:+.4f} vs magnitude's {rise['magnitude']:+.4f} "
                       f"({rise[m] / rise['magnitude']:.2f} of it); per seed "
                       + ", ".join(f"{r:+.4f} vs {h:+.4f}" for r, h in per_seed) + ".")
        gap, ref = wanda["oneshot_eval"][0] - sgpt["oneshot_eval"][0], mag["oneshot_eval"][0] - sgpt["oneshot_eval"][0]
        close = abs(gap) < abs(ref) / 4
        wins = _paired(sgpt, wanda, "oneshot_eval")
        out.append(f"- Wanda close to SparseGPT ({pattern}, one-shot): **{'holds' if close else 'does not hold'}**: "
                   f"Wanda minus SparseGPT {gap:+.4f} against magnitude minus SparseGPT {ref:+.4f}; SparseGPT lower "
                   f"in {wins[0]} of {wins[1]} seeds.")
    present = [m for m in METHODS if get[m]]
    if len(present) > 1:
        spans = {f: (max(get[m][f][0] for m in present) - min(get[m][f][0] for m in present),
                     max(get[m][f][1] for m in present)) for f in ("oneshot_eval", "eval_100", "eval_600")}
        closed = {f: spans[f][0] <= spans[f][1] for f in ("eval_100", "eval_600")}
        best = min(present, key=lambda m: get[m]["eval_600"][0])
        out.append(f"- The gap closed by a short fine-tune ({pattern}): spread of the {len(present)} methods' means "
                   f"{spans['oneshot_eval'][0]:.4f} one-shot, {spans['eval_100'][0]:.4f} after 100 steps "
                   f"({'within' if closed['eval_100'] else 'beyond'} the largest seed std {spans['eval_100'][1]:.4f}), "
                   f"{spans['eval_600'][0]:.4f} after 600 ({'within' if closed['eval_600'] else 'beyond'} "
                   f"{spans['eval_600'][1]:.4f}): **{'closed' if closed['eval_100'] else 'closed by 600 steps' if closed['eval_600'] else 'not closed'}**"
                   f"; lowest after 600: {best} {_cell(get[best], 'eval_600')}; dense start "
                   f"{get[best]['start_eval'][0]:.4f}.")
    if sgpt and seq:
        parts = []
        for f, what in (("oneshot_eval", "one-shot"), ("eval_600", "after 600 steps")):
            wins = _paired(seq, sgpt, f)
            parts.append(f"{what} {seq[f][0] - sgpt[f][0]:+.4f} (sequential lower in {wins[0]} of {wins[1]} seeds)")
        ratio = seq["calib_seconds"][0] / sgpt["calib_seconds"][0]
        beat = seq["oneshot_eval"][0] < sgpt["oneshot_eval"][0] and abs(seq["oneshot_eval"][0] - sgpt["oneshot_eval"][0]) > max(
            seq["oneshot_eval"][1], sgpt["oneshot_eval"][1])
        out.append(f"- Sequential SparseGPT vs one pass ({pattern}): sequential minus one-pass "
                   f"{'; '.join(parts)}, for {ratio:.1f}x the calibration + solve time: "
                   f"**{'sequential better beyond seed noise' if beat else 'no gain beyond seed noise'}**.")
    return out


def oneshot_finding(rows: list[dict], trained: dict | None = None) -> list[str]:
    """The section: table, reference rows of the trained recipes, verdicts, and the rows short of 3 seeds."""
    lines = ["## One-shot pruning from calibration data (gpt, `oneshot` regime)", ""]
    summary = oneshot_summary(rows)
    if not summary:
        return lines + ["Not run yet (`python benchmarks/quality.py --only gpt --regimes oneshot`)."]
    first = next(iter(next(iter(summary.values()))["by_seed"].values()))
    lines += [
        "The same seed's `long` dense run (3 000 steps, trained again since its weights are not in git) pruned in "
        f"one shot, then fine-tuned 600 steps with `asp:N:M,permute=0` (the zeros stay; fresh AdamW at 3e-3, a fresh "
        f"batch stream). Calibration: {first['calibration']} from the training stream (never the validation text), "
        "the same batches for every method of a seed. `magnitude` is ASP's mask without training; `sparsegpt_seq` "
        "is SparseGPT calibrated block by block (`finalize(..., sequential=True)`). Calibration + solve seconds "
        "exclude the compile (done before the timing); they ran with one thread while other jobs shared the two "
        "cores. Losses in nats per character (lower is better), mean ± std over seeds.",
        "",
        "| pattern | method | seeds | dense start | one-shot | +100 steps | +600 steps | calibration + solve (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for pattern in PATTERNS:
        for method in METHODS:
            e = summary.get((method, pattern))
            if e:
                lines.append(f"| {pattern} | {method} | {e['n']} | {_cell(e, 'start_eval')} | {_cell(e, 'oneshot_eval')} "
                             f"| {_cell(e, 'eval_100')} | {_cell(e, 'eval_600')} | {_cell(e, 'calib_seconds', 2)} |")
    if trained:
        ref = [f"{regime} {name} {trained[('gpt', regime, name)]['metric'][0]:.4f} "
               f"(n={trained[('gpt', regime, name)]['n']})" for regime, name in TRAINED if ("gpt", regime, name) in trained]
        lines += ["", "Beside the trained rows of the table above (gpt): " + "; ".join(ref) + ". The `long` rows "
                  "trained 3 000 steps from random init, `finetune asp 2:4` pruned the 600-step dense run and trained "
                  "600 more; the one-shot rows have the 3 000-step dense run plus 600 fine-tune steps behind them."]
        dense = trained.get(("gpt", "long", "dense"))
        if dense:
            diffs = [abs(r["start_eval"] - dense["by_seed"][s]) for e in summary.values()
                     for s, r in e["by_seed"].items() if s in dense["by_seed"]]
            if diffs:
                lines += ["", f"The retrained dense start is within {max(diffs):.4f} nats of the recorded `long dense` "
                          "row of the same seed."]
    lines += ["", "Verdicts (yardsticks: \"far better\": the one-shot loss increase over dense at most half of "
              "magnitude's in every seed; \"close\": Wanda-SparseGPT under a quarter of magnitude-SparseGPT; "
              "\"closed\": the methods' means within the largest seed std of each other):", ""]
    for pattern in PATTERNS:
        lines += _verdicts(summary, pattern)
    short = [f"{m} {p} ({summary[(m, p)]['n']}: seeds {', '.join(map(str, sorted(summary[(m, p)]['by_seed'])))})"
             for p in PATTERNS for m in METHODS if (m, p) in summary and summary[(m, p)]["n"] < 3]
    missing = [f"{m} {p}" for p in PATTERNS for m in METHODS if (m, p) not in summary]
    if short or missing:
        lines += ["", "Rows with fewer than 3 seeds: " + "; ".join(short + [f"{n} (0 seeds)" for n in missing]) + "."]
    return lines
