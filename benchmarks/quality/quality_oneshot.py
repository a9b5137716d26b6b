"""The quality study's ``oneshot`` regime: the long (3 000-step) dense character GPT pruned in one shot
from calibration data, then fine-tuned with the mask kept.

Per seed and pattern (2:4, 4:8, 1:4), four one-shot methods: ``magnitude`` (``asp:N:M,permute=0``
finalized without training), ``wanda``, ``sparsegpt`` (one calibration pass) and ``sparsegpt_seq``
(SparseGPT calibrated block by block, ``finalize(..., sequential=True)``). Calibration: ``CALIB_BATCHES``
batches of ``CALIB_BATCH`` sequences of 64 characters from the training text (their own generator,
seed + ``CALIB_STREAM``), the same for every method of a seed; never the validation text. The pruned
model is then fine-tuned 600 steps with ``asp:N:M,permute=0`` (its mask of an N:M weight is exactly its
non-zeros, so the zeros stay) on a fresh batch stream (seed + ``FRESH_STREAM``, as the finetune regime),
evaluated every 100 steps. A row records the dense start, the one-shot eval before any fine-tune, the
eval after 100 and 600 steps, and the calibration + solve seconds (the compile is done before the
timing, as in ``benchmarks/models/oneshot_cost.py``).
"""

from __future__ import annotations

import time
import warnings

import torch

import nmcompile
from nmcompile.app.run import train_run
from nmcompile.oneshot.solve import reset

METHODS = ("magnitude", "wanda", "sparsegpt", "sparsegpt_seq")
PATTERNS = ("2:4", "4:8", "1:4")
CALIB_BATCHES, CALIB_BATCH, CALIB_STREAM = 4, 32, 2000  # 128 sequences x 64 characters = 8 192 tokens


def spec_of(method: str, pattern: str) -> str:
    """The recipe that prunes: magnitude is ASP's mask without training; sparsegpt_seq is sparsegpt."""
    return f"asp:{pattern},permute=0" if method == "magnitude" else f"{method.removesuffix('_seq')}:{pattern}"


def calibration_batches(corpus, seed: int, context: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + CALIB_STREAM)
    return [corpus.batch("train", CALIB_BATCH, context, gen)[0] for _ in range(CALIB_BATCHES)]


def prune(model, method: str, pattern: str, calib: list[torch.Tensor], exclude) -> tuple[float, list[str]]:
    """Prune ``model`` in place; returns the calibration + solve seconds and the solve's named fallbacks."""
    nmcompile.annotate(model, spec_of(method, pattern), exclude=exclude)
    model.eval()
    if method == "magnitude":
        start = time.perf_counter()
        nmcompile.finalize(model)
        return time.perf_counter() - start, []
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"}, dynamic=False)

    def calibration():
        with torch.no_grad():
            for x in calib:
                compiled(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallbacks are recorded from the report instead
        with torch.no_grad():
            compiled(calib[0])  # compile outside the timing, then forget what it gathered
        reset(model)
        start = time.perf_counter()
        report = nmcompile.finalize(model, calibration=calibration, sequential=method.endswith("_seq"))
    return time.perf_counter() - start, [n for notes in report.fallbacks.values() for n in notes]


def run_oneshot(task, run, dense_file: str, corpus) -> dict:
    """One row: load the seed's long dense model, prune it (``run.name``: ``"<method> <pattern>"``), fine-tune."""
    method, pattern = run.name.split(" ")
    torch.manual_seed(task.seed)
    model = task.make()
    model.load_state_dict(torch.load(dense_file, weights_only=True))
    model.eval()
    with torch.no_grad():
        start_eval = float(task.evaluate(model))
        calib_seconds, fallbacks = prune(model, method, pattern, calibration_batches(corpus, task.seed), task.exclude)
        oneshot_eval = float(task.evaluate(model))
    zeros = {n: p == 0 for n, p in model.named_parameters() if p.dim() == 2 and bool((p == 0).any())}
    torch._dynamo.reset()
    eval_every = max(run.steps // 6, 1)
    out = train_run(model, f"asp:{pattern},permute=0", task.batches, task.loss, task.evaluate, steps=run.steps,
                    lr=3e-3, exclude=task.exclude, eval_every=eval_every,
                    label=f"gpt oneshot {run.name} s{task.seed}")
    record = out["record"]
    effective = nmcompile.effective_weights(model)
    record["zeros_kept"] = all(bool((effective[n][z] == 0).all()) for n, z in zeros.items())
    evals = dict(record["eval"])
    record.update(start_eval=start_eval, oneshot_eval=oneshot_eval, eval_100=evals[eval_every],
                  eval_600=record["final_eval"], calib_seconds=calib_seconds, fallbacks=fallbacks,
                  calibration=f"{CALIB_BATCHES * CALIB_BATCH} train sequences x 64 characters",
                  mean_flip_rate=None, pruned_by=spec_of(method, pattern), sequential=method.endswith("_seq"))
    record["eval"] = [(0, oneshot_eval), *record["eval"]]  # the curve starts at the pruned model
    record.pop("diagnostics", None)  # asp's mask does not move: no flip statistics worth keeping
    return record
