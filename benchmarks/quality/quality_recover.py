"""Getting back what one-shot pruning costs: SparseGPT 2:4 in one shot, then recovery with the mask kept, against
the dense model, on the character GPT and a tiny Llama.

Per seed and model: the study's dense model trained 3 000 steps (``benchmarks/quality/quality_int8.py``'s
``dense_model``), pruned 2:4 by SparseGPT in one shot from the study's calibration batches (128 train sequences of
64 characters), then ``--steps`` AdamW steps (default 300, lr ``--lr``, constant) on a fresh batch stream, every
row with ``asp:2:4,permute=0`` (the mask is the one-shot's non-zeros, kept) through ``backend="nmsparse"``:

- ``finetune``: cross entropy on the labels (plain fine-tuning);
- ``kd``: the dense teacher's logits, KL at temperature 1 (:class:`nmcompile.training.distill.Distillation`);
- ``kd+layers``: that plus SquareHead's layer-wise term (each block's output, normalized MSE), weight 1;
- ``kd+task``: logits plus the labels' cross entropy, weight 1 each;
- ``lora``: ``kd+task`` training only LoRA adapters (``peft``, rank 16, alpha 32, on every block linear; the base
  weights frozen), whose updates the backend masks by each layer's mask; then
  :func:`nmcompile.deploy.merge_adapters`. The row also records the unmerged model's loss and a plain merge's
  (``peft``'s ``merge_and_unload``, then each weight pruned back to 2:4 by magnitude).

A row: dense, one-shot and recovered held-out loss, the share of one-shot's gap to dense that the recovery
closed, seconds a step (the compile excluded: the first 10 steps), and whether every pruned weight is still 2:4.
Rows go to a JSON-lines file (appended; done rows skipped); ``--markdown`` prints the table and the targets.

    python benchmarks/quality/quality_recover.py --seeds 0 1 2          # ~40 min on 2 cores
    python benchmarks/quality/quality_recover.py --bits 4 --methods finetune kd+task   # 2:4+int4, recovered as such
    python benchmarks/quality/quality_recover.py --markdown
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.quality.quality import Task  # noqa: E402
from benchmarks.quality.quality_int8 import GROUP4, LlamaLM, dense_model  # noqa: E402
from benchmarks.quality.quality_oneshot import calibration_batches, prune  # noqa: E402
from benchmarks.toolbox import RESULTS as RESULTS_DIR, append_row, read_rows  # noqa: E402
import nmcompile  # noqa: E402
from nmcompile.app.datasets import CharCorpus, shakespeare  # noqa: E402
from nmcompile.app.run import train_run  # noqa: E402
from nmcompile.masks import keep_mask  # noqa: E402
from nmcompile.training.distill import Distillation  # noqa: E402

RESULTS = str(RESULTS_DIR / "quality_recover.jsonl")
METHODS = ("finetune", "kd", "kd+layers", "kd+task", "lora")
#: the LoRA row's adapters: rank, alpha, and the block linears of each model
LORA = (16, 32, {"gpt": ["qkv", "attn.proj", "fc", "mlp.proj"],
                 "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]})
MODELS = ("gpt", "llama")
FRESH_STREAM = 3000  # the recovery's batches: their own generator, not the dense run's


def _make(model_name: str, task: Task, vocab: int):
    return task.make() if model_name == "gpt" else LlamaLM(vocab)


def recover(model_name: str, method: str, task: Task, corpus, state: dict, steps: int, lr: float,
            bits: int | None = None) -> dict:
    torch.compiler.reset()
    torch.manual_seed(task.seed)
    student, teacher = _make(model_name, task, corpus.vocab), _make(model_name, task, corpus.vocab)
    student.load_state_dict(state)
    teacher.load_state_dict(state)
    exclude = task.exclude if model_name == "gpt" else ["lm.lm_head"]
    grid = f",bits={bits}" + (f",group={GROUP4}" if bits == 4 else "") if bits else ""
    prune(student, "sparsegpt", "2:4" + grid, calibration_batches(corpus, task.seed), exclude)
    student.eval()
    with torch.no_grad():
        oneshot = float(task.evaluate(student))
    zeros = {n: p == 0 for n, p in student.named_parameters() if p.dim() == 2 and bool((p == 0).any())}
    torch.compiler.reset()
    gen = torch.Generator().manual_seed(task.seed + FRESH_STREAM)
    batches = lambda step: corpus.batch("train", 32, 64, gen)  # noqa: E731
    distill, trained = None, student
    if method == "lora":
        import peft

        rank, alpha, targets = LORA
        trained = peft.get_peft_model(student, peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                               target_modules=targets[model_name]))
    if method != "finetune":
        distill = Distillation(trained, teacher, layers=1.0 if "layers" in method else 0.0,
                               task=1.0 if "task" in method or method == "lora" else 0.0)
    times = []

    def timed(step):
        times.append(time.perf_counter())
        return batches(step)

    try:
        out = train_run(trained, "asp:2:4,permute=0" + grid, timed, task.loss, task.evaluate, steps=steps, lr=lr,
                        exclude=exclude, eval_every=steps, label=f"{model_name} {method} s{task.seed}", distill=distill)
    finally:
        if distill is not None:
            distill.close()
    extra = {}
    if method == "lora":  # the masked merge against the unmerged model and a plain merge pruned back to 2:4
        extra["unmerged_eval"] = out["record"]["final_eval"]
        plain = copy.deepcopy(trained).merge_and_unload()
        with torch.no_grad():
            for name, p in plain.named_parameters():
                if name in zeros:
                    p.mul_(keep_mask(p, 2, 4, dim=1))
            extra["plain_merge_eval"] = float(task.evaluate(plain.eval()))
        student = nmcompile.deploy.merge_adapters(trained).eval()
        with torch.no_grad():
            out["record"]["final_eval"] = float(task.evaluate(student))
        extra["merged_2_4"] = nmcompile.check(student).ok
    effective = nmcompile.effective_weights(student) if method != "lora" else dict(student.named_parameters())
    # with bits, a group whose kept value was rounded to code 0 may keep another of its zeros (still 2:4)
    kept = all(bool((effective[n][z] == 0).all()) for n, z in zeros.items()) if not bits else \
        nmcompile.check(student).ok
    per_step = (times[-1] - times[10]) / (len(times) - 11) if len(times) > 11 else None
    return {"bits": bits, "oneshot_eval": oneshot, "recovered_eval": out["record"]["final_eval"], "seconds_per_step": per_step,
            "zeros_kept": kept, "steps": steps, "lr": lr, **extra}


def run(models, seeds, methods, steps: int, lr: float, results: str, bits: int | None = None) -> None:
    done = {(r["model"], r["method"], r["seed"], r["steps"], r.get("bits")) for r in read_rows(results)}
    results_dir = os.path.dirname(os.path.abspath(results))
    corpus = CharCorpus(shakespeare())
    for model_name in models:
        for seed in seeds:
            todo = [m for m in methods if (model_name, m, seed, steps, bits) not in done]
            if not todo:
                continue
            task = Task("gpt", seed, corpus)
            dense = dense_model(model_name, task, corpus, results_dir)
            state = {k: v.clone() for k, v in dense.state_dict().items()}
            dense.eval()
            with torch.no_grad():
                dense_eval = float(task.evaluate(dense))
            for method in todo:
                start = time.perf_counter()
                row = {"model": model_name, "method": method, "seed": seed, "dense_eval": dense_eval,
                       **recover(model_name, method, task, corpus, state, steps, lr, bits)}
                row["closed"] = (row["oneshot_eval"] - row["recovered_eval"]) / (row["oneshot_eval"] - dense_eval)
                row["wall"] = time.perf_counter() - start
                append_row(results, row)


def markdown(results: str) -> str:
    rows = read_rows(results)
    lines = ["| model | values | method | steps | seeds | dense | one-shot 2:4 | recovered | gap closed (per seed) | s/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    verdicts = []
    for model in MODELS:
        for steps, bits in sorted({(r["steps"], r.get("bits") or 0) for r in rows if r["model"] == model}):
            by = {(r["method"], r["seed"]): r for r in rows
                  if r["model"] == model and r["steps"] == steps and (r.get("bits") or 0) == bits}
            values = f"int{bits}" if bits else "float"
            for method in METHODS:
                mine = sorted((r for (m, _), r in by.items() if m == method), key=lambda r: r["seed"])
                if not mine:
                    continue
                mean = lambda key: statistics.fmean(r[key] for r in mine)  # noqa: E731
                closed = ", ".join(f"{r['closed']:.0%}" for r in mine)
                step_s = [r["seconds_per_step"] for r in mine if r["seconds_per_step"]]
                lines.append(f"| {model} | {values} | {method} | {steps} | {len(mine)} | {mean('dense_eval'):.4f} | "
                             f"{mean('oneshot_eval'):.4f} | {mean('recovered_eval'):.4f} | {mean('closed'):.0%} "
                             f"({closed}) | {statistics.fmean(step_s) if step_s else float('nan'):.3f} |")
                if not all(r["zeros_kept"] for r in mine):
                    verdicts.append(f"- {model} {values} {method}: a pruned weight lost a zero (with bits: the "
                                    "model is not 2:4): **mask not kept**")
            for method in METHODS[1:]:
                seeds = sorted(s for m, s in by if m == method and ("finetune", s) in by)
                if model == "gpt" and steps <= 300 and seeds:
                    closes = min(by[(method, s)]["closed"] for s in seeds)
                    beats = all(by[(method, s)]["recovered_eval"] < by[("finetune", s)]["recovered_eval"] for s in seeds)
                    verdicts.append(f"- {model} {values} {method}, {steps} steps: closes at least 90% of the gap in every seed: "
                                    f"**{'met' if closes >= 0.9 else 'missed'}** (least {closes:.0%}); below plain "
                                    f"fine-tuning in every seed: **{'met' if beats else 'missed'}**")
    return "\n".join(lines + [""] + verdicts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bits", type=int, choices=(8, 4), default=None, help="one-shot SparseGPT 2:4 with int8 or "
                        "4-bit values (the joint solve), recovered on the same grids (asp:2:4,permute=0,bits=...)")
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--markdown", action="store_true", help="print the table and the targets, run nothing")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.results))
        return
    run(args.models, args.seeds, args.methods, args.steps, args.lr, args.results, args.bits)


if __name__ == "__main__":
    main()
