"""Why Wanda lands near magnitude on the character GPT: per 2:4 weight of the oneshot regime's dense start
(seed 0), how uneven the calibration inputs' per-column RMS is (Wanda's score is |W| times it) and on
what fraction of positions Wanda's 2:4 mask agrees with magnitude's.

    python benchmarks/wanda_vs_magnitude.py     # after the oneshot regime trained results/dense-gpt-0-3000-long.pt
"""

import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import nmcompile
from nmcompile import masks
from nmcompile.app.datasets import CharCorpus, shakespeare
from quality import Task
from quality_oneshot import calibration_batches
from nmcompile.oneshot.solve import calibrated
from nmcompile.state.records import state_of
corpus = CharCorpus(shakespeare())
task = Task("gpt", 0, corpus)
torch.manual_seed(0)
model = task.make(); model.load_state_dict(torch.load(os.path.join(HERE, "results", "dense-gpt-0-3000-long.pt"), weights_only=True)); model.eval()
dense = {n: p.detach().clone() for n, p in model.named_parameters()}
nmcompile.annotate(model, "wanda:2:4", exclude=task.exclude)
compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"}, dynamic=False)
with torch.no_grad(), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for x in calibration_batches(corpus, 0): compiled(x)
for name, places, ann in calibrated(model):
    stat, count = state_of(places[0][1], places[0][2], ann)
    norm = (stat / count).sqrt()
    w = dense[name]
    keep_mag = masks.prune(w, 2, 4, -1) != 0
    keep_wanda = masks.prune(w * norm, 2, 4, -1) != 0
    agree = (keep_mag == keep_wanda).float().mean().item()
    print(f"{name}: rms input per column max/median {float(norm.max()/norm.median()):.2f}, "
          f"p99/median {float(norm.quantile(0.99)/norm.median()):.2f}; masks agree {agree:.3f}")
