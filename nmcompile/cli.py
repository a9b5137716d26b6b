"""The ``nmcompile`` command.

    nmcompile check PATH [--pattern 2:4] [--dim 1]   N:M compliance of a state dict (.pt) or an ONNX file
    nmcompile recipes                                       the recipes, their keys and defaults
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


from . import recipes
from .inspection import check


def _check(args) -> int:
    try:
        report = check(args.path, args.pattern, dim=args.dim)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"nmcompile check: {err}", file=sys.stderr)
        return 2
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
    p = sub.add_parser(
        "check", help="N:M compliance of a saved state dict (packed 2:4 entries included) or an ONNX file",
        description="Exit status: 0 when every checked tensor complies, 1 when some do not, 2 on unreadable input. "
        "ONNX files written by nmcompile.export_onnx are checked with the pattern and axis recorded per initializer.",
    )
    p.add_argument("path", help="a torch.save'd state dict (.pt/.pth) or an .onnx file")
    p.add_argument("--pattern", default=None, help="N:M to check (default: recorded in the ONNX file, else 2:4)")
    p.add_argument("--dim", type=int, default=1, help="grouping dim without a record: 1 for Linear/Conv and ONNX Gemm "
                   "weights, 0 for GPT-2 Conv1D")
    p.set_defaults(run=_check)
    sub.add_parser("recipes", help="list the recipes").set_defaults(run=_recipes)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
