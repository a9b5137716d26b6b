"""The three GEMMs of a training step's linear layer in bf16 and in float32 on this CPU: why ``nmcompile recover``
trains a bf16 directory in float32 on a CPU without native bf16 arithmetic.

Per shape (a Llama-3.2-1B-shaped MLP projection and attention projection, 128 tokens) and dtype: the forward
``x @ W^T``, the input gradient ``g @ W`` and the weight gradient ``g^T @ x``, each timed as the median of
interleaved rounds (bf16 and float32 alternating), and the float32 product of bf16 operands cast up and the result
cast down (what training in float32 costs against bf16, conversion included). Rows go to a JSON-lines file.

    python benchmarks/training/bf16_gemms.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.toolbox import RESULTS, append_row, interleaved_samples, machine  # noqa: E402

#: (tokens, in, out): the 1B model's gate/up projection and its attention output projection
SHAPES = ((128, 2048, 8192), (128, 2048, 2048))


def gemms(tokens: int, k: int, n: int) -> dict:
    """``{name: call}``: each GEMM in bf16, in float32, and on bf16 operands raised to float32 (cast back)."""
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*s, generator=gen) for s in ((tokens, k), (n, k), (tokens, n)))
    xb, wb, gb = x.bfloat16(), w.bfloat16(), g.bfloat16()
    products = {"forward x@W^T": lambda a, b, c: a @ b.t(), "input gradient g@W": lambda a, b, c: c @ b,
                "weight gradient g^T@x": lambda a, b, c: c.t() @ a}
    fns = {}
    for name, f in products.items():
        fns[f"{name} bfloat16"] = lambda f=f: f(xb, wb, gb)
        fns[f"{name} float32"] = lambda f=f: f(x, w, g)
        fns[f"{name} bfloat16 raised to float32"] = lambda f=f: f(xb.float(), wb.float(), gb.float()).bfloat16()
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", default=str(RESULTS / "bf16_gemms.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for tokens, k, n in SHAPES:
        samples = interleaved_samples(gemms(tokens, k, n), args.rounds, warmup=1)
        for name, times in samples.items():
            append_row(args.results, {"shape": [tokens, k, n], "gemm": name, "seconds": statistics.median(times),
                                      "samples": times, **machine()})


if __name__ == "__main__":
    main()
