"""Above its measured range `nmsparse::cpu24_linear` calls the dense GEMM itself: is that route as
fast as `F.linear`? One process, the same weight and input, interleaved with rotated order:

  dense     F.linear(x, w, b)
  again     F.linear(x, w, b) a second time: the noise floor of this machine
  op route  torch.ops.nmsparse.cpu24_linear(x, values, bits, b, w, out, 0, isa): above max_tokens=0,
            so the op's dense GEMM on the resident weight

Prints each route's median time relative to `dense`, per shape and token count.

    python benchmarks/cpu_dense_route.py [--reps 41]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import nmcompile
from nmcompile.kernels import cpu24

from cpu_deploy import interleaved  # benchmarks/ is the script's directory

SHAPES = [(3072, 768), (4096, 1024), (4096, 4096), (11008, 4096), (4096, 11008)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=41)
    parser.add_argument("--tokens", type=int, nargs="+", default=(64, 256))
    args = parser.parse_args()
    if not cpu24.status().available:
        print(f"the 2:4 CPU kernel is not available here: {cpu24.status().reason}")
        return 0
    isa = cpu24.isas()[0]
    op = torch.ops.nmsparse.cpu24_linear
    print(f"{torch.get_num_threads()} threads, isa {isa}; median time / dense's, {args.reps} rounds")
    with torch.no_grad():
        for out_f, in_f in SHAPES:
            w = nmcompile.masks.prune(torch.randn(out_f, in_f), 2, 4, 1)
            b = torch.randn(out_f)
            packed = nmcompile.pack(w)
            values, bits = cpu24.cpu_layout(packed.values, packed.meta)
            for count in args.tokens:
                x = torch.randn(count, in_f)
                med = interleaved({"dense": lambda: F.linear(x, w, b), "again": lambda: F.linear(x, w, b),
                                   "op route": lambda: op(x, values, bits, b, w, out_f, 0, isa)},
                                  budget=0.0, min_reps=args.reps, max_reps=args.reps)
                print(f"[{out_f}, {in_f}] {count:>3} tokens: dense {med['dense'] * 1e3:8.3f} ms | again "
                      f"{med['again'] / med['dense']:.3f} | op route {med['op route'] / med['dense']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
