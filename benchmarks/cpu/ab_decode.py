"""A/B of the 2:4 decode: a given commit against the working tree, on this machine, in one run.

A kernel or dispatch change is claimed only after this run on the machine at hand (DESIGN.md: a gain on
one CPU must not be a loss on another). Each side runs in its own long-lived child process, with its
own copy of the code on ``PYTHONPATH`` (the commit checked out in a ``git worktree`` under the system's
temporary folder, kept for the next run) and its own decision cache folder; the parent asks the two
children in turn for one timing round each (the order alternating), so both sides see the same machine,
and the idle child waits on its pipe. Each round times greedy decoding (``model.generate``, KV cache) of
the same prompt by the side's dense model and by its 2:4 model, interleaved; the table shows every
round, the medians, and the ratio of the two sides' 2:4 times.

The model (what issue 52 measured): a GPT-2-shaped Hugging Face model with random weights (``--layers``
blocks of width ``--width``), every block weight pruned 2:4 by magnitude, ``nmcompile.finalize(model,
pattern="2:4")``, ``model.forward`` compiled with ``backend="nmsparse"`` (``--packed``: held packed
only first, with ``nmcompile.deploy.pack_weights``; ``--int8 float|int8``: with int8 values, the activations as
given; ``--kernel cpu24``: the 2:4 kernel on every layer, so that
the comparison is the kernel's and not what each side's compile-time timing decided); dense: the same weights
compiled with Inductor.

    python benchmarks/cpu/ab_decode.py --base a9d1e36                  # 8 layers, 1024 wide, fp32, 32 tokens
    python benchmarks/cpu/ab_decode.py --base HEAD~1 --dtype bf16 --rounds 6
    python benchmarks/cpu/ab_decode.py --base a9d1e36 --head 2ef199d      # two commits (bisecting)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import ROOT, machine  # noqa: E402

CHILD = r"""
import json, statistics, sys, time
import torch
import transformers
import nmcompile

layers, width, tokens, prompt, dtype, packed, reps, kernel, int8 = json.loads(sys.argv[1])
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
config = transformers.GPT2Config(n_embd=width, n_layer=layers, n_head=width // 64, n_positions=1024, vocab_size=50257)
torch.manual_seed(0)
dense = transformers.GPT2LMHeadModel(config).eval()
with torch.no_grad():
    for block in dense.transformer.h:
        for conv in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            conv.weight.copy_(nmcompile.masks.prune(conv.weight, 2, 4, 0))
dense = dense.to(dtype).requires_grad_(False)
sparse = transformers.GPT2LMHeadModel(config).eval().to(dtype).requires_grad_(False)
sparse.load_state_dict(dense.state_dict())
nmcompile.finalize(sparse, pattern="2:4")
if int8:  # int8 values, the activations as given (both sides must know activations=)
    nmcompile.deploy.pack_weights(sparse, bits=8, head=None, activations=int8)
elif packed:
    nmcompile.deploy.pack_weights(sparse)
dense.forward = torch.compile(dense.forward)
sparse.forward = torch.compile(sparse.forward, backend="nmsparse", options={"deploy_kernel": kernel})
ids = torch.randint(0, 50257, (1, prompt), generator=torch.Generator().manual_seed(1))
kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
with torch.no_grad():
    out = {name: m.generate(ids, **kwargs) for name, m in (("dense", dense), ("2:4", sparse))}  # compiles
    same = bool(torch.equal(out["dense"], out["2:4"]))
    ranges = {}
    for decision in nmcompile.deploy_report(sparse).values():
        kernel = getattr(decision, "kernel", str(decision))
        key = f"{kernel} up to {getattr(decision, 'max_tokens', '?')}" if kernel == "cpu24" else kernel
        ranges[key] = ranges.get(key, 0) + 1
    print(json.dumps({"ready": True, "same_tokens": same, "threads": torch.get_num_threads(), "decisions": ranges}),
          flush=True)
    for line in sys.stdin:
        times = {"dense": [], "2:4": []}
        for i in range(reps):
            for name, m in ((("dense", dense), ("2:4", sparse)) if i % 2 == 0 else (("2:4", sparse), ("dense", dense))):
                start = time.perf_counter()
                m.generate(ids, **kwargs)
                times[name].append(time.perf_counter() - start)
        print(json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)
"""


def worktree(commit: str) -> Path:
    """A checkout of ``commit`` beside the others this script made (made once, kept)."""
    sha = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"nmcompile-ab-{sha[:12]}"
    if not (path / "nmcompile").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def start(name: str, tree: Path, args, cache: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree), NMCOMPILE_CACHE_DIR=str(cache))
    spec = json.dumps([args.layers, args.width, args.tokens, args.prompt, args.dtype, args.packed, args.reps, args.kernel,
                       args.int8])
    child = subprocess.Popen([sys.executable, "-c", CHILD, spec], cwd=tree, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    ready = json.loads(child.stdout.readline() or "{}")
    if not ready.get("ready"):
        raise SystemExit(f"{name} ({tree}): the child did not start; run it alone to see why")
    print(f"{name}: {tree}, {ready['threads']} threads, 2:4 gives the same greedy tokens as dense: "
          f"{ready['same_tokens']}; layers: {ready['decisions']}", flush=True)
    return child


def ask(child: subprocess.Popen) -> dict:
    child.stdin.write("time\n")
    child.stdin.flush()
    return json.loads(child.stdout.readline())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--head", help="another commit in place of the working tree (bisecting between two)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3, help="generate calls per model and round (median)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--packed", action="store_true", help="hold the 2:4 weights packed only (pack_weights)")
    parser.add_argument("--kernel", choices=("auto", "cpu24"), default="auto",
                        help="the deploy_kernel option: auto (each layer as the dispatch decides: what a user gets) or "
                             "cpu24 (the 2:4 kernel at every layer and token count: the kernel alone, whatever a noisy "
                             "timing decided)")
    parser.add_argument("--int8", choices=("float", "int8"), help="hold the 2:4 weights packed with int8 values "
                        "(pack_weights(bits=8), head kept), their activations as given (both commits must take "
                        "activations=)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    for flag in ("rounds", "reps", "layers", "width", "tokens", "prompt"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    print(json.dumps(machine()), flush=True)
    caches = Path(tempfile.mkdtemp(prefix="nmcompile-ab-caches-"))
    sides = {"base": worktree(args.base), "tree": worktree(args.head) if args.head else ROOT}
    label = {"base": args.base, "tree": args.head or "working tree"}
    children = {name: start(f"{name} {label[name]}", tree, args, caches / name) for name, tree in sides.items()}
    rows = []
    try:
        for r in range(args.rounds):
            for name in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                t = ask(children[name])
                rows.append({"round": r, "side": name, "dense s": t["dense"], "2:4 s": t["2:4"],
                             "speedup": t["dense"] / t["2:4"]})
                print(f"round {r} {name:4}: dense {t['dense']:.3f} s, 2:4 {t['2:4']:.3f} s, "
                      f"{t['dense'] / t['2:4']:.2f}x", flush=True)
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait(timeout=60)
    med = {name: {key: statistics.median(row[key] for row in rows if row["side"] == name)
                  for key in ("dense s", "2:4 s", "speedup")} for name in sides}
    print("\n| code | dense s | 2:4 s | speedup |\n| --- | --- | --- | --- |")
    for name in sides:
        print(f"| {label[name]} | {med[name]['dense s']:.3f} | "
              f"{med[name]['2:4 s']:.3f} | {med[name]['speedup']:.2f}x |")
    ratio = med["tree"]["2:4 s"] / med["base"]["2:4 s"]
    print(f"\n{label['tree']} 2:4 time / {args.base} 2:4 time: {ratio:.3f} (at most 1.05 to claim no regression)")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "medians": med, "ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
