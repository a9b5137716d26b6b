"""What ``nmcompile recover`` costs on a model of real size: a few distillation steps of a 2:4 Llama-3.2-1B-shaped
directory from its dense teacher, time per step and peak resident memory.

    python benchmarks/models/recover_cost.py --pruned /work/models/llama-1b-24 --teacher /work/models/llama-1b

The directories are ``benchmarks/models/make_models.py``'s (random weights, magnitude 2:4: the loss means nothing;
this measures time and memory). Runs :func:`nmcompile.app.recover.recover_model` in this process on the first
200 000 characters of the bundled Shakespeare (held-out: 4 windows), ``--steps`` steps of ``--batch`` windows of
``--seq-len`` tokens, and prints a JSON line: seconds per step (after the first, which compiles), the whole run,
peak resident memory (``VmHWM``) and the parameter bytes of student and teacher.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.toolbox import RESULTS, append_row, machine, peak_mb  # noqa: E402
from nmcompile.app.datasets import shakespeare  # noqa: E402
from nmcompile.app.recover import recover_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pruned", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--inner", default="aot_eager", help="the backend's inner compiler (aot_eager: a short compile)")
    parser.add_argument("--results", default=str(RESULTS / "recover_cost.jsonl"))
    args = parser.parse_args()
    text = shakespeare()
    with tempfile.TemporaryDirectory() as tmp:
        train, held = os.path.join(tmp, "train.txt"), os.path.join(tmp, "held.txt")
        with open(train, "w") as handle:
            handle.write(text[:200_000])
        with open(held, "w") as handle:
            handle.write(text[-2_000:])
        summary = recover_model(args.pruned, args.teacher, train, os.path.join(tmp, "out"), steps=args.steps,
                                seq_len=args.seq_len, batch_size=args.batch, held_out=held, save_every=10_000,
                                inner=args.inner, progress=True)
    row = {"pruned": args.pruned, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
           "inner": args.inner, "seconds_per_step": summary.seconds_per_step, "seconds": summary.seconds,
           "peak_mb": peak_mb(), "loss_before": summary.loss_before, "loss_after": summary.loss_after,
           **machine()}
    print(json.dumps(row))
    append_row(args.results, row, echo=False)


if __name__ == "__main__":
    main()
