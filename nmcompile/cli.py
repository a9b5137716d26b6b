"""The ``nmcompile`` command.

    nmcompile check weights.pt [--pattern 2:4] [--dim 1]   N:M compliance of a saved state dict
    nmcompile recipes                                       the recipes, their keys and defaults
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from . import recipes
from .inspection import check


def _check(args) -> int:
    state = torch.load(args.path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        print(f"{args.path}: expected a state dict (name -> tensor), found {type(state).__name__}")
        return 2
    report = check(state, args.pattern, dim=args.dim)
    print(report)
    return 0 if report.ok else 1


def _recipes(args) -> int:
    for name, cls in recipes.RECIPES.items():
        keys = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls) if f.name not in ("n", "m"))
        print(f"{name}:N:M  ({keys})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nmcompile", description="N:M structured sparsity tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="N:M compliance of the tensors in a saved state dict")
    p.add_argument("path")
    p.add_argument("--pattern", default="2:4", help="N:M, default 2:4")
    p.add_argument("--dim", type=int, default=1, help="grouping dim: 1 for Linear/Conv, 0 for GPT-2 Conv1D")
    p.set_defaults(run=_check)
    sub.add_parser("recipes", help="list the recipes").set_defaults(run=_recipes)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
