"""The quality study's configurations, table and claim checks (benchmarks/quality/*.py) on synthetic results."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.append(ROOT)  # benchmarks/ is not installed

from benchmarks.quality import quality  # noqa: E402
from benchmarks.quality import quality_report as report  # noqa: E402


def row(task, name, seed, metric, flip=None, regime=None):
    out = {"task": task, "name": name, "seed": seed, "final_eval": metric, "mean_flip_rate": flip, "seconds": 1.0,
           "steps_run": 600}
    if regime is not None:
        out["regime"] = regime
    return out


def verdicts(rows):
    return {(c, t, r): v for c, t, r, v in report.claims(report.summarize(rows))}


def test_claims_compare_means_in_the_right_direction():
    rows = [
        row("gpt", "dense", 0, 2.00), row("gpt", "dense", 1, 2.02),
        row("gpt", "ste 2:4", 0, 2.30, 0.02), row("gpt", "ste 2:4", 1, 2.32, 0.03),
        row("gpt", "sr_ste 2:4", 0, 2.20), row("gpt", "sr_ste 2:4", 1, 2.22),
        row("gpt", "s_ste 2:4", 0, 2.10, 0.01), row("gpt", "s_ste 2:4", 1, 2.12, 0.01),
        row("gpt", "asp 2:4", 0, 2.01), row("gpt", "asp 2:4", 1, 2.01),  # fine-tuned from dense: not a rival
        row("mnist", "ste 2:4", 0, 0.95), row("mnist", "sr_ste 2:4", 0, 0.90),  # accuracy: higher wins
        row("mnist", "ste 1:8", 0, 0.90), row("mnist", "ste 1:8", 1, 0.92),
        row("mnist", "sr_ste 1:8", 0, 0.905), row("mnist", "sr_ste 1:8", 1, 0.925),
    ]
    got = verdicts(rows)  # rows without a regime are the scratch regime's
    assert got[("SR-STE better than STE at 2:4", "gpt", "scratch")].startswith("holds")  # lower loss
    assert got[("SR-STE better than STE at 2:4", "mnist", "scratch")].startswith("does not hold")
    assert got[("S-STE closest to dense at 2:4", "gpt", "scratch")].startswith(
        "holds: behind dense by +0.1000 (s_ste 2:4) vs +0.2000 (sr_ste 2:4")
    assert "within seed noise" not in got[("SR-STE better than STE at 2:4", "gpt", "scratch")]
    # means 0.005 apart with a spread of 0.014 per side: the order is reported, marked as noise
    assert got[("SR-STE better than STE at 1:8", "mnist", "scratch")].startswith("holds (within seed noise)")
    assert got[("S-STE's flip rate lower than STE's (2:4)", "gpt", "scratch")].startswith("holds")
    table = report.markdown(rows)
    assert "| gpt | scratch | ste 2:4 | 600 | 2.3100 ± 0.0141 | 2 |" in table


def test_each_regime_gets_its_own_verdicts():
    rows = [row("gpt", "step 2:4", s, 2.00 + s / 100, regime="finetune") for s in range(2)]
    rows += [row("gpt", "sr_ste 2:4", s, 2.10 + s / 100, regime="finetune") for s in range(2)]
    rows += [row("gpt", "dense", s, 1.90 + s / 100, regime="finetune") for s in range(2)]
    rows += [row("gpt", "asp 2:4", s, 1.95 + s / 100, regime="finetune") for s in range(2)]
    rows += [row("gpt", "step 2:4", s, 2.30, regime="long") for s in range(2)]
    rows += [row("gpt", "sr_ste 2:4", s, 2.20, regime="long") for s in range(2)]
    rows += [row("gpt", "transposable 2:4", s, 2.25, regime="long") for s in range(2)]
    rows += [row("gpt", "step 2:4", s, 2.40) for s in range(2)] + [row("gpt", "sr_ste 2:4", s, 2.50) for s in range(2)]
    got = verdicts(rows)
    claim = "STEP better than SR-STE under Adam (2:4)"
    assert got[(claim, "gpt", "finetune")].startswith("holds")
    assert got[(claim, "gpt", "long")].startswith("does not hold")
    assert got[(claim, "gpt", "scratch")].startswith("holds")
    # asp 0.05 behind the dense control with a spread of 0.007: not a match
    assert got[("ASP 2:4 fine-tuned matches dense", "gpt", "finetune")].startswith("does not hold")
    assert got[(claim, "gpt", "finetune")].endswith("better in 2 of 2 seeds")
    assert got[("Transposable 2:4 within 0.1 nats of SR-STE 2:4", "gpt", "long")].startswith("holds: behind by +0.0500")
    table = report.markdown(rows)
    assert table.index("| gpt | scratch |") < table.index("| gpt | finetune |") < table.index("| gpt | long |")
    rows[0]["seconds"] = 3593.0  # one finetune run slowed by other work: the fastest seed's pace ignores it
    assert "| finetune | 4 | 8 | 1.00 | 0.00 |" in report.cost(rows) and "| all | 9 | 18 | 1.00 | 0.01 |" in report.cost(rows)


def test_every_configuration_is_listed_once_with_dense_first():
    configs = quality.configs(["mnist"], [0], scale=0.1)
    assert {c.regime for c in configs} == {"scratch"}  # finetune and long are GPT-only
    names = [c.name for c in configs]
    assert names[0] == "dense" and len(names) == len(set(names)) == 22 + 6
    assert {n for n in names if n.endswith(("1:16", "1:32"))} == {
        f"{r} {p}" for r in ("sr_ste", "mdgf", "sdgf") for p in ("1:16", "1:32")}
    assert quality.Run("mnist", "scratch", "transposable 4:8", "transposable:4:8", 0, 60) in configs
    mdgf = {c.name: c.spec for c in configs}["mdgf 1:8"]
    assert mdgf == "mdgf:1:8,decay_coef=0.1,finetune_fraction=0.2"  # sized to the 60-step run
    gpt = quality.configs(["gpt"], [0])
    finetune = [c.name for c in gpt if c.regime == "finetune"]
    assert finetune == ["dense", "sr_ste 2:4", "s_ste 2:4", "step 2:4", "asp 2:4"]
    long = [c for c in gpt if c.regime == "long"]
    assert [c.name for c in long] == ["dense", "sr_ste 2:4", "s_ste 2:4", "step 2:4", "transposable 2:4"]
    assert {c.steps for c in long} == {3000}


def test_finetune_batches_come_from_a_fresh_stream():
    import torch

    data = (torch.randn(5000, 784), torch.randint(10, (5000,)))
    first = quality.Task("mnist", 0, data).batches(0)[1]
    assert torch.equal(first, quality.Task("mnist", 0, data).batches(0)[1])
    assert not torch.equal(first, quality.Task("mnist", 0, data, stream=quality.FRESH_STREAM).batches(0)[1])


def test_doc_rewrite_keeps_the_hand_written_notes(tmp_path):
    rows = [dict(row("mnist", "dense", 0, 0.95), eval=[(10, 0.9)], commit="abc")]
    doc = tmp_path / "docs" / "quality.md"
    doc.parent.mkdir()
    report.write_doc(rows, str(doc), str(tmp_path / "results.jsonl"), expected=2)
    assert report.NOTES not in doc.read_text() and "partial: 1 of 2 runs" in doc.read_text()
    doc.write_text(doc.read_text() + f"\n{report.NOTES}\n\nSTEP switched early.\n")
    report.write_doc(rows + [dict(row("mnist", "dense", 1, 0.97), eval=[(10, 0.9)], commit="abc")], str(doc),
                     str(tmp_path / "results.jsonl"), expected=2)
    text = doc.read_text()
    assert text.count(report.NOTES) == 1 and text.rstrip().endswith("STEP switched early.")
    assert "| mnist | scratch | dense | 600 | 0.9600 ± 0.0141 | 2 |" in text  # the table is rewritten
    assert "(complete;" in text


def test_compare_puts_a_rerun_beside_the_recorded_run_in_seed_spreads():
    rows = [dict(row("gpt", "dense", s, 2.00 + s / 50), commit="old") for s in range(2)]
    rerun = [dict(row("gpt", "dense", 0, 2.007), commit="new"), dict(row("gpt", "ste 2:4", 0, 2.5), commit="new")]
    text = report.compare(rows, rerun)
    assert "| gpt | scratch | dense | 0 | 2.0000 (old) | 2.0070 (new) | +0.0070 | 0.0141 |" in text
    assert "ste 2:4" not in text  # only runs both files hold
    assert text.endswith("Largest difference: 0.49 seed standard deviations.")


def test_head_rows_and_the_cosine_regime_are_configured():
    gpt = quality.configs(["gpt"], [0])
    head = [c for c in gpt if "+head" in c.name]
    assert [(c.regime, c.name, c.spec) for c in head] == [
        ("scratch", "sr_ste+head 2:4", "sr_ste:2:4"), ("scratch", "s_ste+head 2:4", "s_ste:2:4")]
    cosine = [c for c in gpt if c.regime == "cosine"]
    assert [c.name for c in cosine] == ["dense", "sr_ste 2:4", "step 2:4", "asp 2:4"]  # dense first: asp starts there
    assert {c.steps for c in cosine} == {3000}
    assert not any("+head" in c.name for c in quality.configs(["mnist"], [0]))
    assert quality.dense_path("r", "gpt", 0, 3000, "cosine") != quality.dense_path("r", "gpt", 0, 3000)


def test_head_verdict_and_the_order_under_each_schedule():
    rows = [row("gpt", "dense", s, 1.89 + s / 100) for s in range(3)]
    rows += [dict(row("gpt", "sr_ste 2:4", s, 1.92 + s / 100), commit="old") for s in range(3)]
    rows += [dict(row("gpt", "sr_ste+head 2:4", s, 1.96 + s / 100), commit="new") for s in range(3)]  # 0.04 worse in every seed
    rows += [row("gpt", "s_ste 2:4", s, 1.93 + s / 100) for s in range(3)]
    rows += [row("gpt", "s_ste+head 2:4", s, 1.94 + (s % 2) / 50) for s in range(3)]  # mixed: within noise
    for regime, step, sr in (("long", 1.75, 1.69), ("cosine", 1.66, 1.68)):
        rows += [row("gpt", n, s, v + s / 1000, regime=regime) for s in range(3)
                 for n, v in (("dense", 1.65), ("step 2:4", step), ("sr_ste 2:4", sr))]
    rows += [row("gpt", "asp 2:4", s, 1.655, regime="cosine") for s in range(3)]
    summary = report.summarize(rows)
    got = verdicts(rows)
    assert got[("A sparse output head costs nothing beyond seed noise (sr_ste 2:4)", "gpt", "scratch")].startswith(
        "does not hold: head sparse 1.9700 ± 0.0100 vs head dense 1.9300 ± 0.0100, worse by +0.0400; "
        "head dense better in 3 of 3 seeds")
    assert got[("A sparse output head costs nothing beyond seed noise (s_ste 2:4)", "gpt", "scratch")].startswith(
        "holds (within seed noise)")
    # +head rows are not rivals in "closest to dense"
    assert "(sr_ste 2:4, best of the others)" in got[("S-STE closest to dense at 2:4", "gpt", "scratch")]
    order = "Order of STEP, SR-STE, ASP at 2:4 (best first)"
    assert got[(order, "gpt", "long")] == "sr_ste 2:4 1.6910, step 2:4 1.7510"
    assert got[(order, "gpt", "cosine")] == "asp 2:4 1.6550, step 2:4 1.6610, sr_ste 2:4 1.6810"
    head = "\n".join(report.head_finding(summary))
    assert ("- sr_ste 2:4: head sparse 1.9700 ± 0.0100 vs head dense 1.9300 ± 0.0100 (3 and 3 runs, commits new vs old): "
            "+0.0400") in head
    assert "per seed (0, 1, 2) +0.0400, +0.0400, +0.0400; the sparse body alone is +0.0300 from dense" in head
    assert "beyond seed noise in 1 of 2 recipes and not worse in every seed" in head  # s_ste: noise
    schedule = "\n".join(report.schedule_finding(summary))
    assert "| step 2:4 | 1.7510 ± 0.0010 (n=3) | 1.6610 ± 0.0010 (n=3) | -0.0900 |" in schedule
    assert "the order changes (STEP ahead under the schedule)" in schedule
    assert report.schedule_finding(report.summarize(rows[:9]))[-1].startswith("No row of the cosine regime")


def test_oneshot_rows_are_configured_and_rendered_with_their_verdicts():
    gpt = quality.configs(["gpt"], [0])
    oneshot = [c for c in gpt if c.regime == "oneshot"]
    assert [c.name for c in oneshot[:4]] == ["magnitude 2:4", "wanda 2:4", "sparsegpt 2:4", "sparsegpt_seq 2:4"]
    assert len(oneshot) == 12 and {c.steps for c in oneshot} == {600}
    assert {c.name: c.spec for c in oneshot}["magnitude 1:4"] == "asp:1:4,permute=0"
    assert not any(c.regime == "oneshot" for c in quality.configs(["mnist"], [0]))
    rises = {"magnitude": 0.40, "wanda": 0.12, "sparsegpt": 0.10, "sparsegpt_seq": 0.095}
    rows = [dict(row("gpt", f"{m} 2:4", s, 1.80 + s / 100, regime="oneshot"), start_eval=1.67 + s / 100,
                 oneshot_eval=1.67 + rise + s / 100, eval_100=1.79 + s / 100, eval_600=1.80 + s / 100,
                 calib_seconds=1.0 if m == "sparsegpt" else 2.0, calibration="128 train sequences x 64 characters")
            for m, rise in rises.items() for s in range(3)]
    rows = [r for r in rows if not (r["name"] == "wanda 2:4" and r["seed"] == 2)]
    text = "\n".join(report.oneshot_finding(rows, report.summarize(rows)))
    assert "| 2:4 | magnitude | 3 | 1.6800 ± 0.0100 | 2.0800 ± 0.0100 | 1.8000 ± 0.0100 | 1.8100 ± 0.0100 |" in text
    assert "- sparsegpt far better than magnitude (2:4, one-shot): **holds** (3 seeds: 0, 1, 2)" in text
    assert "- wanda far better than magnitude (2:4, one-shot): **holds** (2 seeds: 0, 1)" in text
    assert "- Wanda close to SparseGPT (2:4, one-shot): **holds** (2 seeds: 0, 1): Wanda minus SparseGPT +0.0200" in text
    # wanda lacks seed 2: the comparisons use seeds 0 and 1 only
    assert ("(2:4, 4 methods, 2 seeds: 0, 1): spread of the means 0.3050 one-shot, 0.0000 after 100 steps "
            "(within seed noise)") in text and "**closed (within seed noise) by 100 steps**" in text
    assert "(2:4, 3 seeds: 0, 1, 2): sequential minus one-pass one-shot -0.0050" in text
    assert "for 2.0x the calibration + solve time: **no gain beyond seed noise**" in text
    assert "Rows with fewer than 3 seeds: wanda 2:4 (2: seeds 0, 1); magnitude 4:8 (0 seeds)" in text
