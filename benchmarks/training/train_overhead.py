"""Training-step overhead of nmsparse recipes vs Inductor dense and an eager module swap.

Model: 4 (or --layers) x (Linear(1024, 1024) + ReLU), batch 256, fp32, MSE loss, torch.optim.Adam. Every variant
runs interleaved round-robin in one process, so host noise hits all of them alike. Printed per
variant: its median step, that over dense's median step ("vs dense"), and the median over rounds
of its step over dense's step in the same round ("paired"), and its mean step over dense's mean
step ("mean"): the mean counts the steps that refresh a mask or search a permutation every k
steps (transposable, bi_mask), which the medians leave out. ``--adam both`` runs every variant
twice in the same rounds, with PyTorch's default Adam and with ``Adam(fused=True)``, and compares
each with the dense model under the same optimizer.

Variants:
  dense       torch.compile(backend="inductor")
  nm/<r>      torch.compile(backend="nmsparse") with recipe <r> (SPECS below); schedules count the Adam
              optimizer's steps by themselves (nmcompile.hook_optimizer only with --diagnostics-every);
              the default projections="auto", which on the CPU shares one mask kernel among the weights
              of a shape that three or more weights have
  inline/<r>  (with --inline) the same with options={"projections": "inline"}: each weight's mask math
              fused into the graph
  swap/<r>    eager module swap: each Linear's weight goes through a per-layer autograd.Function
              (how the papers' reference code works), mask by torch.topk + scatter (ste, sr_ste, s_ste)
  prune/asp   (with asp) PyTorch's own fixed-mask fine-tune: torch.nn.utils.prune.custom_from_mask
              with a 2:4 magnitude mask on each Linear, torch.compile(backend="inductor"): what any
              fixed mask costs the optimizer, without nmcompile

    python benchmarks/training/train_overhead.py                # step-time table
    python benchmarks/training/train_overhead.py --compile-time # + first-step times, one process each
    python benchmarks/training/train_overhead.py --inline --layers 12 --compile-time --steps 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import prune

import nmcompile

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import interleaved_samples  # noqa: E402

SPECS = {
    "ste": "ste:2:4",
    "sr_ste": "sr_ste:2:4",
    "s_ste": "s_ste:2:4",
    "step1": "step:2:4,total_steps=1000000",  # phase 1: dense + AutoSwitch statistic
    "step2": "step:2:4,total_steps=1000000,t_min=0,t_max=0",  # phase 2 from the first step: frozen-moment update
    "mdgf": "mdgf:2:4",
    "sdgf": "sdgf:2:4,total_steps=1000000",  # frame 3:4 (the first) all along
    "asp": "asp:2:4,permute=false",
    "transposable": "transposable:2:4",  # the recipe's defaults (every, decay)
    "transposable_k1": "transposable:2:4,every=1",  # mask refreshed after every optimizer step
    "transposable_k2": "transposable:2:4,every=2",
    "transposable_k4": "transposable:2:4,every=4",
    "transposable_k40": "transposable:2:4,every=40",
    "transposable_k40_plain": "transposable:2:4,every=40,decay=0",  # the settings before decay existed
    "bi_mask": "bi_mask:2:4,every=100",
    "ste_mvue24": "ste:2:4,wgrad=mvue24",
    "s_ste_mvue24": "s_ste:2:4,wgrad=mvue24",
}
RECIPES = ("ste", "sr_ste", "s_ste")
SWAPPABLE = set(RECIPES)
WIDTH, BATCH, LAYERS = 1024, 256, 4
DIAGNOSTICS_EVERY = 0
ADAMS = {"default": {}, "fused": {"fused": True}}  # torch.optim.Adam arguments per --adam choice


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[mod for _ in range(LAYERS) for mod in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def topk_mask(w, n=2, m=4):
    groups = w.abs().reshape(-1, m)
    idx = groups.topk(n, dim=-1).indices
    return torch.zeros_like(groups).scatter_(-1, idx, 1.0).reshape(w.shape)


class _SwapSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w * topk_mask(w)

    @staticmethod
    def backward(ctx, g):
        return g


class _SwapSRSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, decay):
        mask = topk_mask(w)
        ctx.save_for_backward(w, mask)
        ctx.decay = decay
        return w * mask

    @staticmethod
    def backward(ctx, g):
        w, mask = ctx.saved_tensors
        return g + ctx.decay * (1 - mask) * w, None


class _SwapSSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, beta):
        a = w.abs().reshape(-1, 4)
        t = a.sort(dim=-1, descending=True).values[:, 2:3]
        return beta * (torch.sign(w) * torch.clamp(a - t, min=0).reshape(w.shape))

    @staticmethod
    def backward(ctx, g):
        return g, None


class SwapLinear(nn.Module):
    """The module-swap baseline: replaces nn.Linear and masks its weight in an autograd.Function."""

    def __init__(self, linear: nn.Linear, recipe: str):
        super().__init__()
        self.weight, self.bias, self.recipe = linear.weight, linear.bias, recipe
        beta = nmcompile.masks.soft_threshold_scale(linear.weight, 2, 4, 1)
        self.register_buffer("beta", beta)

    def forward(self, x):
        if self.recipe == "ste":
            w = _SwapSTE.apply(self.weight)
        elif self.recipe == "sr_ste":
            w = _SwapSRSTE.apply(self.weight, 2e-4)
        else:
            w = _SwapSSTE.apply(self.weight, self.beta)
        return nn.functional.linear(x, w, self.bias)


def build(variant: str, adam: str):
    model = mlp()
    if variant == "dense":
        run = torch.compile(model, backend="inductor")
    elif variant.startswith(("nm/", "inline/")):
        kind, recipe = variant.split("/")
        nmcompile.annotate(model, SPECS[recipe])
        run = torch.compile(model, backend="nmsparse", options={"projections": "inline" if kind == "inline" else "auto"})
    elif variant == "prune/asp":
        for mod in model:
            if isinstance(mod, nn.Linear):
                prune.custom_from_mask(mod, "weight", topk_mask(mod.weight.detach()).bool())
        run = torch.compile(model, backend="inductor")
    else:
        recipe = variant[5:]
        model = nn.Sequential(*[SwapLinear(m, recipe) if isinstance(m, nn.Linear) else m for m in model])
        run = model
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, **ADAMS[adam])
    if variant.startswith(("nm/", "inline/")) and DIAGNOSTICS_EVERY:
        nmcompile.hook_optimizer(model, opt, diagnostics_every=DIAGNOSTICS_EVERY)
    return model, run, opt


def step(run, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    loss = ((run(x) - y) ** 2).mean()
    loss.backward()
    opt.step()


def first_step(variant: str, primed: bool) -> float:
    if primed:  # pay Inductor's one-time costs (imports, C++ prefix header) on an unrelated graph
        torch.compile(lambda t: torch.relu(t * 2), backend="inductor")(torch.randn(3, 5))
        torch._dynamo.reset()
    _, run, opt = build(variant, "default")
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    start = time.perf_counter()
    step(run, opt, x, y)
    return time.perf_counter() - start


def compile_times(variants, primed: bool) -> dict[str, float]:
    """First-step seconds of each variant in its own process with an empty Inductor cache."""
    out = {}
    for variant in variants:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            cmd = [sys.executable, __file__, "--first-step", variant, "--layers", str(LAYERS)]
            cmd += ["--primed"] if primed else []
            result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            out[variant] = float(result.stdout.strip().splitlines()[-1])
    return out


def step_table(args, names) -> None:
    """Time every variant, interleaved round-robin, and print the table."""
    adams = list(ADAMS) if args.adam == "both" else [args.adam]
    variants = [(name, adam) for adam in adams for name in names]
    runs = {v: build(*v) for v in variants}
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    steps = {v: (lambda run=run, opt=opt: step(run, opt, x, y)) for v, (_, run, opt) in runs.items()}
    times = interleaved_samples(steps, args.steps, warmup=args.warmup)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {LAYERS} layers, {args.steps} interleaved steps")
    print(f"diagnostics every {args.diagnostics_every} steps")
    for adam in adams:
        dense = times[("dense", adam)]
        how = "Adam(fused=True)" if adam == "fused" else "default Adam (single-tensor loop on CPU)"
        print(f"\n{how}, each variant against dense with the same optimizer")
        print(f"{'variant':<26}{'median ms':>10}{'vs dense':>10}{'paired':>10}{'mean':>10}")
        for name in names:
            t = times[(name, adam)]
            # paired: the median over rounds of (this variant's step / dense's step in the same
            # round), which cancels host slowdowns that last longer than one round
            paired = statistics.median(a / b for a, b in zip(t, dense))
            ratio = statistics.median(t) / statistics.median(dense)
            mean = statistics.fmean(t) / statistics.fmean(dense)
            print(f"{name:<26}{statistics.median(t) * 1e3:>10.2f}{ratio:>10.3f}{paired:>10.3f}{mean:>10.3f}")


def main() -> None:
    global LAYERS, DIAGNOSTICS_EVERY
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), help=f"any of {', '.join(SPECS)}")
    parser.add_argument("--diagnostics-every", type=int, default=0, help="record mask diagnostics (0: off)")
    parser.add_argument("--no-swap", action="store_true", help="skip the eager module-swap variants")
    parser.add_argument("--inline", action="store_true", help='add each recipe with projections="inline"')
    parser.add_argument("--layers", type=int, default=LAYERS, help="Linear+ReLU layers of the MLP")
    parser.add_argument("--compile-time", action="store_true")
    parser.add_argument(
        "--adam", choices=(*ADAMS, "both"), default="default",
        help="PyTorch's default Adam (on CPU its single-tensor loop), Adam(fused=True), or both side by side",
    )
    parser.add_argument("--first-step", help=argparse.SUPPRESS)
    parser.add_argument("--primed", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    LAYERS = args.layers
    if args.first_step:
        print(first_step(args.first_step, args.primed))
        return
    DIAGNOSTICS_EVERY = args.diagnostics_every

    names = ["dense"] + [f"nm/{r}" for r in args.recipes]
    if args.inline:
        names += [f"inline/{r}" for r in args.recipes]
    if not args.no_swap:
        names += [f"swap/{r}" for r in args.recipes if r in SWAPPABLE]
    if "asp" in args.recipes:
        names.append("prune/asp")
    if args.steps > 0:
        step_table(args, names)
    if args.compile_time:
        for primed in (False, True):
            first = compile_times([n for n in names if not n.startswith(("swap/", "prune/"))], primed)
            how = "primed by an unrelated compile" if primed else "nothing cached"
            print(f"\nfirst step, empty Inductor cache, one process each, {how}")
            for v, sec in first.items():
                print(f"{v:<14}{sec:>10.2f} s{sec / first['dense']:>9.2f}x")


if __name__ == "__main__":
    main()
