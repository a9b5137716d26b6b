"""Train a small MLP on real data (scikit-learn's bundled 8x8 digits) with an N:M recipe.

The model code is plain PyTorch: the recipe is declared with ``nmcompile.annotate`` and applied by
``torch.compile(model, backend="nmsparse")``, next to a dense baseline trained the same way. Then
the deploy path: ``nmcompile.finalize`` bakes the N:M weights in, the finalized model is compiled
for inference (per-layer kernel report), saved as a plain and as a packed 2:4 checkpoint, and
exported to ONNX, verified N:M and checked against onnxruntime.

    python examples/train_digits.py --recipe s_ste:2:4 --steps 300

It writes into ``runs/digits/`` (ignored by git; ``--out`` elsewhere). Times are reported apart:
each model's first step (its compile) and the steps after it, with Inductor's one-time start-up paid
before either, so that the model compiled first is not charged for it.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import nmcompile


def data(device):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32, device=device) / 16.0
    y = torch.tensor(digits.target, device=device)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=gen).to(device)
    split = int(0.8 * len(x))
    return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def train(model, compiled, train_set, steps, batch=128):
    """``(final loss, seconds of the first step (the compile), seconds of the steps after it)``."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = train_set
    gen = torch.Generator().manual_seed(1)
    start = first = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(len(x), (batch,), generator=gen).to(x.device)
        loss = nn.functional.cross_entropy(compiled(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 0:
            first = time.perf_counter()
    return loss.item(), first - start, time.perf_counter() - first


@torch.no_grad()
def accuracy(compiled, test_set):
    x, y = test_set
    return (compiled(x).argmax(-1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="s_ste:2:4", help="e.g. ste:2:4, sr_ste:2:4,decay=2e-4, s_ste:1:4")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--out", default=os.path.join("runs", "digits", "digits_nm.pt"),
                        help="where to save the N:M weights (.pt; the packed checkpoint and .onnx next to it; default "
                        "runs/digits/digits_nm.pt, ignored by git)")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.manual_seed(0)
    train_set, test_set = data("cpu")

    dense = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    sparse = copy.deepcopy(dense)
    report = nmcompile.annotate(sparse, args.recipe, exclude=["4"])  # keep the classifier dense
    print(report)

    torch.compile(lambda v: v * 2, backend=args.inner)(torch.ones(2))
    results = {}  # Inductor's one-time start-up paid above, so the first model compiled is not charged for it
    for name, model, backend, options in (
        ("dense", dense, "inductor" if args.inner == "inductor" else "aot_eager", None),
        (args.recipe, sparse, "nmsparse", {"inner": args.inner}),
    ):
        compiled = torch.compile(model, backend=backend, options=options)
        loss, compile_s, train_s = train(model, compiled, train_set, args.steps)
        results[name] = (loss, accuracy(compiled, test_set), compile_s, train_s)

    for name, (loss, acc, compile_s, train_s) in results.items():
        print(f"{name:>24}: final train loss {loss:.4f}, test accuracy {acc:.3f} (first step with its compile "
              f"{compile_s:.1f} s, then {args.steps - 1} steps {train_s:.1f} s)")

    check = nmcompile.check(sparse)
    print(check)
    if not check.ok:
        raise SystemExit("effective weights are not N:M")
    deploy(sparse, test_set, args.out)


def deploy(model, test_set, out: str) -> None:
    """Finalize, compile for inference, save plain and packed checkpoints, export and verify ONNX."""
    print(nmcompile.finalize(model))  # effective weights baked in, training state dropped
    model.eval()
    torch.compiler.reset()
    inference = torch.compile(model, backend="nmsparse")
    print(f"finalized model, compiled for inference: test accuracy {accuracy(inference, test_set):.3f}")
    for name, decision in nmcompile.deploy_report(model).items():
        print(f"  {name}: {decision}")
    torch.save(model.state_dict(), out)  # loads into the plain model, no nmcompile needed
    packed = out.removesuffix(".pt") + ".packed.pt"
    torch.save(nmcompile.deploy.pack_state_dict(model.half().state_dict()), packed)
    torch.save(model.state_dict(), out + ".fp16")
    model.float()
    sizes = [os.path.getsize(path) for path in (out + ".fp16", packed)]
    os.remove(out + ".fp16")
    print(f"saved {out}; fp16 checkpoint with packed 2:4 weights: {sizes[1]} bytes, {sizes[1] / sizes[0]:.0%} of dense fp16")
    onnx_path = out.removesuffix(".pt") + ".onnx"
    print(nmcompile.export_onnx(model, test_set[0][:8], onnx_path))
if __name__ == "__main__":
    main()
