"""What to check instead, when a check without a layout record fails: a ``--dim`` and ``--only`` that fit the file.

A weights file holds every weight of the model, also the dense ones (embeddings, a head left dense), and
nothing in it says along which dim a weight is grouped (GPT-2's ``Conv1D`` is ``[in, out]``: dim 0).
:func:`suggestion` looks at which tensors are N:M along dim 0 and along dim 1 and proposes the dim that
most comply along and the narrowest ``--only`` globs that select exactly those.
"""

from __future__ import annotations

import fnmatch
import re

__all__ = ["suggestion"]


def _generalise(name: str) -> str:
    """``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.*.attn.c_attn.weight``."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", name)


def _globs(good: list[str], bad: list[str]) -> list[str] | None:
    """The fewest globs that match every name of ``good`` and none of ``bad`` (None if none fit)."""
    prefixes = []
    for name in good:
        general = _generalise(name)
        head = general.split("*")[0] + "*" if "*" in general else None
        if head and head not in prefixes:
            prefixes.append(head)
    for candidates in (prefixes, sorted({_generalise(n) for n in good}), sorted(good)):
        if not candidates or len(candidates) > 8:
            continue
        covers = all(any(fnmatch.fnmatchcase(n, g) for g in candidates) for n in good)
        clean = not any(fnmatch.fnmatchcase(n, g) for n in bad for g in candidates)
        if covers and clean:
            return candidates
    return None


def suggestion(violations: dict[str, dict[int, int]], pattern, dim: int, path: str) -> str:
    """A hint for ``nmcompile check`` (empty when there is nothing better to say).

    ``violations``: ``{name: {dim: groups that violate along it}}`` of the >= 2-D tensors checked."""
    dims = sorted({d for v in violations.values() for d in v})
    complying = {d: [n for n, v in violations.items() if v.get(d) == 0] for d in dims}
    best = max(dims, key=lambda d: (len(complying[d]), d == dim), default=dim)
    good = complying.get(best, [])
    if not good:
        return (f"nmcompile check: no tensor of {path} is {pattern} along dim {' or '.join(map(str, dims))}: its "
                "weights are dense (was the model pruned and finalized before it was saved?)")
    bad = [n for n in violations if n not in good]
    where = " (GPT-2's Conv1D weights are [in, out], grouped along dim 0)" if best == 0 else ""
    head = (f"nmcompile check: {len(good)} of {len(violations)} tensors are {pattern} along dim {best}{where}; "
            f"the others ({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}) are dense")
    globs = _globs(good, bad)
    dim_flag = f" --dim {best}" if best != 1 else ""
    if globs is None:
        return head + f"; check the N:M ones by naming them with --only GLOB (repeatable){dim_flag and ', with' + dim_flag}"
    only = " ".join(f"--only '{g}'" for g in globs)
    return head + f". Check those with: nmcompile check {path}{dim_flag} {only}"
