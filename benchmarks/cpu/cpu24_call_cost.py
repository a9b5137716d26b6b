"""What one ``nmsparse::cpu24_linear`` call costs around its kernel: a layer small enough that the
product takes about a microsecond, called from Python, against ``F.linear`` on its dense weight.

A decoding step calls the op once per linear layer (112 times a token for a 1B Llama), so this cost
is paid per layer per token, beside the bytes. Timed under ``torch.no_grad`` (what Hugging Face's
``generate`` uses: the Autograd key is still dispatched) and under ``torch.inference_mode`` (which
skips it), fp32 and bf16 (whose activations are widened to fp32 and whose outputs are narrowed back
inside the op). Medians of 7 rounds of 2000 calls each.

    python benchmarks/cpu/cpu24_call_cost.py [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import nmcompile
from nmcompile.kernels import cpu24


def per_call_us(fn, calls: int = 2000, rounds: int = 7) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", type=int, nargs=2, default=(64, 256), metavar=("N", "K"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu24.status().available:
        raise SystemExit(f"no 2:4 CPU kernel here: {cpu24.status().reason}")
    isa = "avx2" if "avx2" in cpu24.isas() else cpu24.isas()[0]
    op = torch.ops.nmsparse.cpu24_linear.default
    n, k = args.shape
    print(f"[{n}, {k}] layer, one token, {args.threads} thread(s), isa {isa}, nmcompile "
          f"{nmcompile.__version__}, torch {torch.__version__}; microseconds a call")
    print("| dtype | cpu24_linear, no_grad | cpu24_linear, inference_mode | F.linear, no_grad |")
    print("| --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        w = nmcompile.masks.prune(torch.randn(n, k, dtype=dtype), 2, 4, 1)
        values, bits, _ = cpu24.cpu_pack(w)
        x = torch.randn(1, 1, k, dtype=dtype)
        with torch.no_grad():
            sparse = per_call_us(lambda: op(x, values, bits, None, None, n, -1, isa))
            dense = per_call_us(lambda: F.linear(x, w))
        with torch.inference_mode():
            sparse_inference = per_call_us(lambda: op(x, values, bits, None, None, n, -1, isa))
        print(f"| {str(dtype).removeprefix('torch.')} | {sparse:.1f} | {sparse_inference:.1f} | {dense:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
