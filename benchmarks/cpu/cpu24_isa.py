"""Which ISA path of the 2:4 CPU kernel is fastest here, per dtype and token count, against dense.

One process, cold weights (``--layers`` copies of a ``--shape`` weight, read in turn, so that each call
streams its weight from memory as in a decoding model), every path and dense ``F.linear`` called
round-robin, each round starting one later (``--rounds``, medians). Each ISA this CPU runs is called by name, so the table shows
what ``cpu24.best_isa`` (:data:`nmcompile.kernels.cpu24.ISAS`) chooses between.

    python benchmarks/cpu/cpu24_isa.py --threads 1
    python benchmarks/cpu/cpu24_isa.py --threads 2 --tokens 1 2 4 16 64 --dtypes fp32 bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from nmcompile import masks
from nmcompile.kernels import cpu24

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import interleaved_samples  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", type=int, nargs=2, default=(8192, 2048), metavar=("OUT", "IN"))
    parser.add_argument("--layers", type=int, default=8, help="weight copies read in turn (default 8)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 16, 64])
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=["fp32", "bf16", "fp16"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    state = cpu24.status()
    if not state.available:
        raise SystemExit(f"no 2:4 CPU kernel here: {state.reason}")
    torch.set_num_threads(args.threads)
    out_f, in_f = args.shape
    op = torch.ops.nmsparse.cpu24_linear
    print(f"threads {args.threads}, {args.layers} x [{out_f}, {in_f}], ISAs {', '.join(cpu24.isas())}; "
          f"best_isa: " + ", ".join(f"{d} {cpu24.best_isa(DTYPES[d])}" for d in args.dtypes))
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        g = torch.Generator().manual_seed(0)
        weights = [masks.prune(torch.randn(out_f, in_f, generator=g), 2, 4, 1).to(dtype) for _ in range(args.layers)]
        packed = [cpu24.cpu_pack(w)[:2] for w in weights]
        paths = [isa for isa in cpu24.isas() if isa != "avx512_bf16" or dtype == torch.bfloat16]
        for tokens in args.tokens:
            x = torch.randn(tokens, in_f, generator=g).to(dtype)
            fns = {"dense": lambda: [F.linear(x, w) for w in weights]}
            for isa in paths:
                fns[isa] = lambda isa=isa: [op(x, v, b, None, None, out_f, -1, isa) for v, b in packed]
            with torch.no_grad():
                times = interleaved_samples(fns, args.rounds)
            dense = statistics.median(times["dense"])
            print(f"{dname} {tokens:4} tokens: " + "  ".join(
                f"{name} {statistics.median(t) * 1e3:.2f} ms ({dense / statistics.median(t):.2f}x)"
                for name, t in times.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
