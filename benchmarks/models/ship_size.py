"""What a pruned Hugging Face folder ships for CPU serving, against what dense loads and GPUs need, and how
fast each loads packed.

Given a 2:4 directory (for example ``llama-1b-24`` from ``make_models.py``, or an ``nmcompile prune`` output),
loads it dense, saves it with ``nmcompile.deploy.save_pretrained`` (so it holds ``model_packed.pt``), copies
the CPU-serving set (configuration and tokenizer files, ``nmcompile.json``, ``model_packed.pt``) into a
folder of its own, and reports the bytes of each set against the dense folder's. Then, in fresh processes,
alternating, ``load_pretrained(DIR, packed=True, measure=False)`` of the whole folder and of the CPU-only one
(and, with ``--dense DIR``, ``from_pretrained`` of the dense model): seconds from the process's first line to
the loaded model and to the first token's logits (eager), which must be equal for the two 2:4 folders,
and the load's peak resident memory over the process's baseline (imports and the kernel's library loaded).

    python benchmarks/models/ship_size.py /work/models/llama-1b-24 --dense /work/models/llama-1b --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_SET = ("config.json", "generation_config.json", "nmcompile.json", "model_packed.pt", "tokenizer.json",
           "tokenizer_config.json", "special_tokens_map.json")

LOAD = """
import sys, time, torch
start = time.perf_counter()
torch.set_num_threads(int(sys.argv[2]))
import transformers
from nmcompile.kernels import cpu24
from benchmarks.toolbox import peak_mb, reset_peak, resident_mb
if sys.argv[3] != "dense":
    from nmcompile.deploy import load_pretrained
    cpu24.status()  # the kernel's library: part of the baseline, as the imports are
reset_peak()  # the peak counts from here
baseline = resident_mb()
if sys.argv[3] == "dense":
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True, dtype="auto")
else:
    model = load_pretrained(sys.argv[1], packed=True, measure=False)
loaded, peak = time.perf_counter() - start, peak_mb() - baseline
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])).logits[0, -1]
print(loaded, time.perf_counter() - start, float(logits.double().sum()), int(logits.argmax()), peak)
"""


def _bytes(folder: str, names=None) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if names is None or n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--work", default="/tmp/nmcompile-ship")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dense", default=None, help="the dense model's folder: its from_pretrained load timed too")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch  # noqa: F401  (the parent only saves)
    from nmcompile.deploy import load_pretrained, save_pretrained

    whole, cpu = os.path.join(args.work, "whole"), os.path.join(args.work, "cpu-only")
    shutil.rmtree(args.work, ignore_errors=True)
    start = time.perf_counter()
    model = load_pretrained(args.directory)
    save_pretrained(model, whole)
    del model
    saved_s = time.perf_counter() - start
    for name in os.listdir(args.directory):  # the tokenizer files, as prune writes them
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(args.directory, name), os.path.join(whole, name))
    os.makedirs(cpu)
    for name in CPU_SET:
        if os.path.isfile(os.path.join(whole, name)):
            shutil.copy(os.path.join(whole, name), os.path.join(cpu, name))
    dense_set = [n for n in os.listdir(whole) if n != "model_packed.pt"]
    sizes = {"dense folder (input)": _bytes(args.directory), "whole output": _bytes(whole),
             "CPU serving set": _bytes(cpu), "dense/GPU set": _bytes(whole, dense_set)}
    for what, size in sizes.items():
        print(f"{what:22s} {size / 2**20:10.1f} MiB  {size / sizes['dense/GPU set']:.3f}x of the dense/GPU set")
    rows = []
    for round_ in range(args.rounds):
        runs = [("whole", whole), ("cpu-only", cpu)] + ([("dense", args.dense)] if args.dense else [])
        for label, folder in runs:
            done = subprocess.run([sys.executable, "-c", LOAD, folder, str(args.threads), label], capture_output=True,
                                  text=True, check=True, cwd=ROOT)
            loaded, first, total, top, peak = done.stdout.split()
            rows.append({"round": round_, "folder": label, "load_s": float(loaded), "first_token_s": float(first),
                         "logit_sum": float(total), "top": int(top), "load_peak_MiB": float(peak)})
            print(f"round {round_} {label:8s} load {float(loaded):6.1f} s  first token {float(first):6.1f} s  "
                  f"load peak {float(peak):7.0f} MiB  logits sum {float(total):.6f}  top {top}", flush=True)
    same = len({(r["logit_sum"], r["top"]) for r in rows if r["folder"] != "dense"}) == 1
    print(f"same first-token logits from both folders: {same}; save took {saved_s:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"directory": args.directory, "sizes": sizes, "rows": rows, "same": same,
                       "threads": args.threads}, handle, indent=1)


if __name__ == "__main__":
    main()
