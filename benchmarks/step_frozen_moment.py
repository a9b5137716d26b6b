"""How large STEP's frozen second moment is against Adam's live one, in the quality study's MNIST run.

STEP divides phase-2 updates by sqrt(v) frozen at the switch; Adam would divide by the live,
bias-corrected moment (which nmcompile keeps updating in phase 2). This prints the ratio
sqrt(frozen v / live v) per layer (median and 10th/90th percentiles) at a few steps: above 1, STEP's
steps are that much smaller than Adam's. Same model, data, seed and recipe as
``benchmarks/quality.py``'s ``mnist step 2:4`` run (600 AdamW steps, lr 1e-3).

    python benchmarks/step_frozen_moment.py [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

import nmcompile
from nmcompile.app.datasets import mnist_5k
from quality import Task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    task = Task("mnist", args.seed, mnist_5k())
    torch.manual_seed(args.seed)
    model = task.make()
    nmcompile.annotate(model, f"step:2:4,total_steps={args.steps}", exclude=task.exclude)
    compiled = torch.compile(model, backend="nmsparse", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    nmcompile.hook_optimizer(model, opt)
    buffers = dict(model.named_buffers())
    checkpoints = {args.steps // 6, args.steps // 2, args.steps}
    for step in range(1, args.steps + 1):
        x, y = task.batches(step - 1)
        loss = task.loss(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step not in checkpoints:
            continue
        for name, param in model.named_parameters():
            frozen = buffers.get(f"{name}_nm_v")
            if frozen is None:
                continue
            state = opt.state[param]
            live = state["exp_avg_sq"] / (1 - opt.param_groups[0]["betas"][1] ** float(state["step"]))
            both = (frozen > 0) & (live > 0)
            ratio = (frozen[both] / live[both]).sqrt()
            switch = int(buffers[f"{name}_nm_switch_step"])
            print(f"step {step:4d} {name}: switched at {switch}; sqrt(frozen v / live v) median "
                  f"{ratio.median():.2f}, p10 {ratio.quantile(0.1):.2f}, p90 {ratio.quantile(0.9):.2f}")


if __name__ == "__main__":
    main()
