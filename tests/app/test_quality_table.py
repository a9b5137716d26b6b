"""The quality study's table and claim checks (benchmarks/quality.py) on synthetic results."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import quality  # noqa: E402


def row(task, name, seed, metric, flip=None):
    return {"task": task, "name": name, "seed": seed, "final_eval": metric, "mean_flip_rate": flip, "seconds": 1.0}


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
    verdicts = {(c, t): v for c, t, v in quality.claims(quality.summarize(rows))}
    assert verdicts[("SR-STE better than STE at 2:4", "gpt")].startswith("holds")  # lower loss
    assert verdicts[("SR-STE better than STE at 2:4", "mnist")].startswith("does not hold")
    assert verdicts[("S-STE closest to dense at 2:4", "gpt")].startswith("holds: behind dense by +0.1000 (s_ste 2:4) vs +0.2000 (sr_ste 2:4")
    assert "within seed noise" not in verdicts[("SR-STE better than STE at 2:4", "gpt")]
    # means 0.005 apart with a spread of 0.014 per side: the order is reported, marked as noise
    assert verdicts[("SR-STE better than STE at 1:8", "mnist")].startswith("holds (within seed noise)")
    assert verdicts[("S-STE's flip rate lower than STE's (2:4)", "gpt")].startswith("holds")
    table = quality.markdown(rows)
    assert "| gpt | ste 2:4 | 2.3100 ± 0.0141 | 2 |" in table


def test_every_configuration_is_listed_once_with_dense_first():
    configs = quality.configs(["mnist"], [0], scale=0.1)
    names = [c[1] for c in configs]
    assert names[0] == "dense" and len(names) == len(set(names)) == 22
    assert ("mnist", "transposable 4:8", "transposable:4:8", 0) in configs
    mdgf = dict((c[1], c[2]) for c in configs)["mdgf 1:8"]
    assert mdgf == "mdgf:1:8,decay_coef=0.1,finetune_fraction=0.2"  # sized to the 60-step run


def test_doc_rewrite_keeps_the_hand_written_notes(tmp_path):
    rows = [dict(row("mnist", "dense", 0, 0.95), eval=[(10, 0.9)], commit="abc")]
    doc = tmp_path / "docs" / "quality.md"
    doc.parent.mkdir()
    quality.write_doc(rows, str(doc), str(tmp_path / "results.jsonl"))
    assert quality.NOTES not in doc.read_text()
    doc.write_text(doc.read_text() + f"\n{quality.NOTES}\n\nSTEP switched early.\n")
    quality.write_doc(rows + [dict(row("mnist", "dense", 1, 0.97), eval=[(10, 0.9)], commit="abc")], str(doc),
                      str(tmp_path / "results.jsonl"))
    text = doc.read_text()
    assert text.count(quality.NOTES) == 1 and text.rstrip().endswith("STEP switched early.")
    assert "| mnist | dense | 0.9600 ± 0.0141 | 2 |" in text  # the table is rewritten
