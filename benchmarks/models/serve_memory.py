"""Resident memory of a serving process: a deployed directory loaded packed, compiled, and decoding.

Prints the process's resident memory (VmRSS) and its peak (VmHWM) after the import, after
``nmcompile.deploy.load_pretrained(DIR, packed=True)`` and after each greedy ``generate``. Run it
twice: the first process compiles (and times the kernel where no decision is cached), a second one
finds both cached, as a restarted server does.

    python benchmarks/models/serve_memory.py /work/models/llama-8b-24 --compiled
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import peak_mb, resident_mb  # noqa: E402


def report(what: str) -> None:
    peak = peak_mb()
    print(f"{what}: resident {resident_mb():.0f} MiB, peak {peak:.0f} MiB ({peak * 2**20 / 1e9:.2f} GB)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="a directory written by nmcompile prune or nmcompile.deploy.save_pretrained")
    parser.add_argument("--compiled", action="store_true", help="torch.compile(backend='nmsparse') the forward")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    from nmcompile.deploy import load_pretrained

    if args.threads:
        torch.set_num_threads(args.threads)
    report("import")
    start = time.perf_counter()
    model = load_pretrained(args.dir, packed=True)
    report(f"load ({time.perf_counter() - start:.1f} s)")
    if args.compiled:
        model.forward = torch.compile(model.forward, backend="nmsparse")
    ids = torch.randint(0, 700, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for call in range(args.calls):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
            report(f"generate {call} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
