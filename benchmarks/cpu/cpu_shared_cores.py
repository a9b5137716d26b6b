"""The 2:4 CPU kernel on shared cores: 1 against 2 threads, quiet and with a busy loop pinned to one core.

The issue's case: four finalized 2:4 layers of [4096, 4096] fp32 held packed, one token through all
four in turn (ms per token), the op ``nmsparse::cpu24_linear`` and dense ``F.linear``, each in its
own process per thread count (medians of rounds): an OpenMP team that just ran (dense's GEMV at 2
threads) spins for milliseconds on its cores, which would slow whatever is timed right after it
when a core is busy. ``--interleaved`` times kernel and dense alternately in one process instead,
as a model mixing both runs them. Then the same with a second process spinning on the last core (``os.sched_setaffinity``),
as another user's job would. The target: with the busy loop, the kernel at 2 threads is no slower
than at 1. Also prints the kernel's one-thread bytes per second (packed bytes / time) beside dense
GEMV's (dense bytes / time), the quiet 1-thread figures.

    python benchmarks/cpu/cpu_shared_cores.py                 # the best ISA here, fp32
    python benchmarks/cpu/cpu_shared_cores.py --isa avx2      # the AVX2 path on an AVX-512 CPU
    python benchmarks/cpu/cpu_shared_cores.py --layers 8 --out benchmarks/results/cpu_shared_cores.json
    python benchmarks/cpu/cpu_shared_cores.py --int8 --dtype bf16 --interleaved   # 2:4 with int8 values

Numbers are as good as the machine is quiet apart from the loop this script starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import nmcompile
from nmcompile.kernels import cpu24
from nmcompile.kernels.cpu24.quantize import quantize_layout

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import busy_loop, cpu_name, interleaved_samples  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def weights(layers: int, size: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        w = nmcompile.masks.prune(torch.randn(size, size, generator=generator), 2, 4, 1).to(dtype)
        packed = nmcompile.pack(w)
        values, bits = cpu24.cpu_layout(packed.values, packed.meta)
        out.append((w, values, bits, *quantize_layout(values, size)))  # and the int8 codes, scales
    return out


def methods(stack, isa: str, size: int, dtype: torch.dtype, int8: bool = False) -> dict:
    x0 = torch.randn(1, size).to(dtype)
    op, q8 = torch.ops.nmsparse.cpu24_linear, torch.ops.nmsparse.cpu24_linear_q8

    def run(sparse: bool):
        def call():
            x = x0
            for w, values, bits, codes, scales in stack:
                if not sparse:
                    x = F.linear(x, w)
                elif int8:
                    x = q8(x, codes, bits, scales, None, size, -1, isa)
                else:
                    x = op(x, values, bits, None, None, size, -1, isa)
            return x

        return call

    return {"kernel": run(True), "dense": run(False)}


def child(args) -> int:
    """One thread count and method (or both, interleaved); prints {method: times} as JSON."""
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.child)
    stack = weights(args.layers, args.size, dtype)
    fns = methods(stack, args.isa, args.size, dtype, args.int8)
    if args.method != "both":
        fns = {args.method: fns[args.method]}
    with torch.no_grad():
        times = interleaved_samples(fns, args.rounds)  # seconds of each call, rotated rounds
    print(json.dumps(times))
    return 0


def measure(args, threads: int) -> dict:
    out = {}
    for method in ("both",) if args.interleaved else ("kernel", "dense"):
        cmd = [sys.executable, __file__, "--child", str(threads), "--method", method, "--isa", args.isa, "--dtype",
               args.dtype, "--layers", str(args.layers), "--size", str(args.size), "--rounds", str(args.rounds)]
        cmd += ["--int8"] if args.int8 else []
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        times = json.loads(done.stdout.strip().splitlines()[-1])
        out.update({f"{name}_{threads}t": {"median_ms": statistics.median(t) * 1e3,
                                           "q1_ms": statistics.quantiles(t, n=4)[0] * 1e3,
                                           "q3_ms": statistics.quantiles(t, n=4)[2] * 1e3} for name, t in times.items()})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--isa", default=None, help="the op's ISA (default: the best for the dtype here)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--out")
    parser.add_argument("--interleaved", action="store_true", help="kernel and dense alternately in one process")
    parser.add_argument("--int8", action="store_true", help="the kernel on int8 values (cpu24_linear_q8), activations "
                        "in --dtype")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--method", default="both", choices=("kernel", "dense", "both"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not cpu24.status().available:
        print(f"no 2:4 CPU kernel here: {cpu24.status().reason}", file=sys.stderr)
        return 2
    args.isa = args.isa or cpu24.best_isa(DTYPES[args.dtype])
    if args.child:
        return child(args)
    isa = args.isa
    cores = sorted(os.sched_getaffinity(0))
    element = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    dense_bytes = args.layers * args.size * args.size * element
    value_bytes = 1 if args.int8 else element
    packed_bytes = args.layers * (args.size * args.size // 2 * value_bytes + args.size * args.size // 16 * 2
                                  + (args.size * 4 if args.int8 else 0))
    result = {"cpu": cpu_name(), "torch": torch.__version__, "isa": isa, "dtype": args.dtype, "int8": args.int8,
              "layers": args.layers, "size": args.size, "cores": cores, "interleaved": args.interleaved,
              "load_before": os.getloadavg()[0], "nmcompile": os.path.dirname(nmcompile.__file__)}
    result["quiet"] = {**measure(args, 1), **measure(args, 2)}
    loop = busy_loop(cores[-1])
    try:
        time.sleep(0.5)
        result["busy"] = {**measure(args, 1), **measure(args, 2)}
    finally:
        loop.kill()
        loop.wait()
    result["load_after"] = os.getloadavg()[0]
    quiet = result["quiet"]
    result["kernel_1t_gbps"] = packed_bytes / quiet["kernel_1t"]["median_ms"] * 1e3 / 1e9
    result["dense_1t_gbps"] = dense_bytes / quiet["dense_1t"]["median_ms"] * 1e3 / 1e9
    print(f"{result['cpu']}, torch {result['torch']}, isa {isa}, {args.layers} x [{args.size}, {args.size}] "
          f"{args.dtype}, 1 token, ms per token (median [q1, q3] of {args.rounds} rounds); 1-minute load average "
          f"{result['load_before']:.2f} before, {result['load_after']:.2f} after; nmcompile from {result['nmcompile']}")
    for state in ("quiet", "busy"):
        cells = "  ".join(f"{name} {m['median_ms']:6.2f} [{m['q1_ms']:.2f}, {m['q3_ms']:.2f}]"
                          for name, m in result[state].items())
        print(f"{state:>5}: {cells}")
    busy = result["busy"]
    print(f"busy: kernel 2t/1t time {busy['kernel_2t']['median_ms'] / busy['kernel_1t']['median_ms']:.2f} "
          f"(target <= 1); quiet 1 thread: kernel {result['kernel_1t_gbps']:.1f} GB/s packed, "
          f"dense {result['dense_1t_gbps']:.1f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
