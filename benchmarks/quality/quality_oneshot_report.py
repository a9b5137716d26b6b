"""The ``oneshot`` regime's section of docs/quality.md: per method and pattern the dense start, the
one-shot loss, the loss after 100 and 600 fine-tune steps and the calibration + solve seconds (3-seed
means ± std), and the verdicts on the papers' claims (SparseGPT, Wanda far better than magnitude at
2:4; Wanda close to SparseGPT; a short fine-tune closes the gap; sequential vs one-pass calibration).

Yardsticks, stated in the section: "far better" means the one-shot loss increase over dense is at
most half of magnitude's, in every seed; "close" means the Wanda-SparseGPT difference is under a
quarter of the magnitude-SparseGPT difference; a gap is "closed" when the methods' means after the
fine-tune lie within the largest seed std of each other ("mostly closed": under 10% of the one-shot
spread of the means left). Each comparison uses the seeds its rows share.
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


def _common(*entries) -> list[int]:
    return sorted(set.intersection(*(set(e["by_seed"]) for e in entries)))


def _mean(entry, field, seeds) -> float:
    return statistics.fmean(entry["by_seed"][s][field] for s in seeds)


def _std(entry, field, seeds) -> float:
    return statistics.stdev(entry["by_seed"][s][field] for s in seeds) if len(seeds) > 1 else 0.0


def _n(seeds) -> str:
    return f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''}: {', '.join(map(str, seeds))}"


def _verdicts(summary, pattern: str) -> list[str]:
    """Each comparison on the seeds its rows share (means over those seeds only)."""
    get = {m: summary.get((m, pattern)) for m in METHODS}
    out = []
    mag, wanda, sgpt, seq = (get[m] for m in METHODS)
    for m in ("wanda", "sparsegpt"):
        if not (mag and get[m]):
            continue
        seeds = _common(mag, get[m])
        per_seed = [(get[m]["by_seed"][s]["oneshot_eval"] - get[m]["by_seed"][s]["start_eval"],
                     mag["by_seed"][s]["oneshot_eval"] - mag["by_seed"][s]["start_eval"]) for s in seeds]
        rise, ref = (statistics.fmean(x) for x in zip(*per_seed))
        far, better = all(r <= h / 2 for r, h in per_seed), all(r < h for r, h in per_seed)
        verdict = "holds" if far else ("better, but not far better" if better else "does not hold")
        out.append(f"- {m} far better than magnitude ({pattern}, one-shot): **{verdict}** ({_n(seeds)}): "
                   f"loss over dense {rise:+.4f} vs magnitude's {ref:+.4f} ({rise / ref:.2f} of it); per seed "
                   + ", ".join(f"{r:+.4f} vs {h:+.4f}" for r, h in per_seed) + ".")
    if mag and wanda and sgpt:
        seeds = _common(mag, wanda, sgpt)
        gap = _mean(wanda, "oneshot_eval", seeds) - _mean(sgpt, "oneshot_eval", seeds)
        ref = _mean(mag, "oneshot_eval", seeds) - _mean(sgpt, "oneshot_eval", seeds)
        wins = _paired(sgpt, wanda, "oneshot_eval")
        out.append(f"- Wanda close to SparseGPT ({pattern}, one-shot): **{'holds' if abs(gap) < abs(ref) / 4 else 'does not hold'}** "
                   f"({_n(seeds)}): Wanda minus SparseGPT {gap:+.4f} against magnitude minus SparseGPT {ref:+.4f}; "
                   f"SparseGPT lower in {wins[0]} of {wins[1]} seeds.")
    present = [get[m] for m in METHODS if get[m]]
    if len(present) > 1:
        seeds = _common(*present)
        spans = {f: max(_mean(e, f, seeds) for e in present) - min(_mean(e, f, seeds) for e in present)
                 for f in ("oneshot_eval", "eval_100", "eval_600")}
        noise = {f: max(_std(e, f, seeds) for e in present) for f in ("eval_100", "eval_600")}

        def state(f):
            if len(seeds) > 1 and spans[f] <= noise[f]:
                return "within seed noise"
            return f"{100 * spans[f] / max(spans['oneshot_eval'], 1e-9):.0f}% of the one-shot spread left" + (
                f", largest seed std {noise[f]:.4f}" if len(seeds) > 1 else ", 1 seed")

        verdict = ("no one-shot gap to close (means under 0.01 apart)" if spans["oneshot_eval"] < 0.01 else
                   "closed (within seed noise) by 100 steps" if "noise" in state("eval_100") else
                   "closed (within seed noise) by 600 steps" if "noise" in state("eval_600") else
                   "mostly closed (under 10% of the one-shot spread left), not to within seed noise"
                   if spans["eval_100"] < spans["oneshot_eval"] / 10 or spans["eval_600"] < spans["oneshot_eval"] / 10
                   else "not closed")
        after = ", ".join(f"{m} {_mean(get[m], 'eval_600', seeds):.4f}" for m in METHODS if get[m])
        out.append(f"- The gap closed by a short fine-tune ({pattern}, {len(present)} methods, {_n(seeds)}): spread of "
                   f"the means {spans['oneshot_eval']:.4f} one-shot, {spans['eval_100']:.4f} after 100 steps "
                   f"({state('eval_100')}), {spans['eval_600']:.4f} after 600 ({state('eval_600')}): **{verdict}**; "
                   f"after 600: {after}; dense start {_mean(present[0], 'start_eval', seeds):.4f}.")
    if sgpt and seq:
        seeds = _common(sgpt, seq)
        parts = []
        for f, what in (("oneshot_eval", "one-shot"), ("eval_600", "after 600 steps")):
            wins = _paired(seq, sgpt, f)
            parts.append(f"{what} {_mean(seq, f, seeds) - _mean(sgpt, f, seeds):+.4f} "
                         f"(sequential lower in {wins[0]} of {wins[1]} seeds)")
        ratio = _mean(seq, "calib_seconds", seeds) / _mean(sgpt, "calib_seconds", seeds)
        diff = _mean(seq, "oneshot_eval", seeds) - _mean(sgpt, "oneshot_eval", seeds)
        noise = max(_std(seq, "oneshot_eval", seeds), _std(sgpt, "oneshot_eval", seeds))
        verdict = ("undecided (1 seed)" if len(seeds) < 2 else
                   "sequential better beyond seed noise" if -diff > noise else "no gain beyond seed noise")
        out.append(f"- Sequential SparseGPT vs one pass ({pattern}, {_n(seeds)}): sequential minus one-pass "
                   f"{'; '.join(parts)}, for {ratio:.1f}x the calibration + solve time: **{verdict}**.")
    return out


def oneshot_finding(rows: list[dict], trained: dict | None = None) -> list[str]:
    """The section: table, reference rows of the trained recipes, verdicts, and the rows short of 3 seeds."""
    lines = ["## One-shot pruning from calibration data (gpt, `oneshot` regime)", ""]
    summary = oneshot_summary(rows)
    if not summary:
        return lines + ["Not run yet (`python benchmarks/quality/quality.py --only gpt --regimes oneshot`)."]
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
              "\"closed\": the methods' means within the largest seed std of each other, \"mostly closed\": under 10% "
              "of the one-shot spread left; each comparison on the seeds its rows share):", ""]
    for pattern in PATTERNS:
        lines += _verdicts(summary, pattern)
    short = [f"{m} {p} ({summary[(m, p)]['n']}: seeds {', '.join(map(str, sorted(summary[(m, p)]['by_seed'])))})"
             for p in PATTERNS for m in METHODS if (m, p) in summary and summary[(m, p)]["n"] < 3]
    missing = [f"{m} {p}" for p in PATTERNS for m in METHODS if (m, p) not in summary]
    if short or missing:
        lines += ["", "Rows with fewer than 3 seeds: " + "; ".join(short + [f"{n} (0 seeds)" for n in missing]) + "."]
    return lines
