"""N:M checks of weights files and model directories, with the layout record where there is one.

A directory written by :func:`nmcompile.deploy.save_pretrained` or ``nmcompile prune`` (or a weights file in
it, or a safetensors file that carries the record in its metadata) is checked weight by weight along each
weight's recorded dim, with its recorded pattern; the weights the record keeps dense are listed as not
checked, with why; a weight transformers wrote in parts under other names (a Mixtral's fused experts, one
Linear weight per expert) is checked part by part, as the record's ``saved`` names them. Without a record,
every >= 2-D tensor is checked along ``dim`` (default 1), and a failed check gets a hint
(:func:`suggestion`) that fits the file. Safetensors files are read one tensor at a time. A directory whose
record marks weights ``bits`` 8 or 4 has their codes checked against the dense files' values too.

A checkpoint often nests the model's state dict (``{"model": sd, "optimizer": ..., "epoch": 3}``):
:func:`find_state_dict` takes the one dict of tensors it holds, preferring the entries named
``state_dict``, ``model_state_dict`` or ``model`` when there are several (an optimizer's state is a
dict of tensors too), and raises ValueError when it cannot tell. Files are read with
``torch.load(weights_only=True)``; anything that cannot be read that way is a ValueError naming the
file and why, in one line (:func:`load_state_dict`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from collections.abc import Callable, Iterable, Mapping

import torch

from .. import masks
from ..kernels.format24 import META_SUFFIX, packed_dims, packed_record, unpack_state_dict
from ..pattern import NMPattern
from ..masks.compliance import CheckReport, check_one, selects
from .conversions import part_dim
from .quantized_weights import CodesFile, check_against
from .layout import PACKED_FILE, Layout, read_layout
from .weight_files import tensor_sources, weight_files

__all__ = ["check_path", "check_state", "load_state_dict", "find_state_dict"]

#: names under which checkpoints keep the model's state dict, first preferred
PREFERRED = ("state_dict", "model_state_dict", "model")


def _tensor_dicts(obj: Mapping, path: tuple = ()):
    """``(path, mapping)`` for each mapping in ``obj`` (``obj`` included) that holds tensors directly."""
    if any(isinstance(v, torch.Tensor) for v in obj.values()):
        yield path, obj
        return
    for key, value in obj.items():
        if isinstance(value, Mapping):
            yield from _tensor_dicts(value, (*path, key))


def _where(path: tuple) -> str:
    return "".join(f"[{key!r}]" for key in path)


def find_state_dict(obj: Mapping, what: str) -> tuple[Mapping, str]:
    """``(state dict, where)``: the dict of tensors in ``obj``, and its place (``"['model']"``; ``""``
    for ``obj`` itself). ``what`` names ``obj`` in errors."""
    found = list(_tensor_dicts(obj))
    if len(found) > 1:
        for name in PREFERRED:
            named = [(path, sd) for path, sd in found if path[:1] == (name,)]
            if len(named) == 1:
                found = named
                break
    if not found:
        raise ValueError(
            f"{what} holds no tensors; expected a state dict (name -> tensor), e.g. torch.save(model.state_dict(), "
            "path), or a checkpoint dict that holds one"
        )
    if len(found) > 1:
        places = ", ".join(_where(path) for path, _ in found[:5]) + (" ..." if len(found) > 5 else "")
        raise ValueError(
            f"{what} holds several dicts of tensors ({places}) and none is under "
            f"{' / '.join(repr(p) for p in PREFERRED)}; pass the state dict to check, e.g. "
            f"nmcompile.check(torch.load(path){_where(found[0][0])})"
        )
    path, state = found[0]
    return state, _where(path)


def _why_unreadable(err: Exception) -> str:
    if isinstance(err, EOFError):
        return "the file is empty or ends early (truncated?)"
    if isinstance(err, OSError):
        return f"not a readable torch.save file: its zip archive ends early or is damaged (truncated or corrupt? {err})"
    text = str(err)
    refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if refused:
        return (
            f"it pickles a {refused.group(1)} object, which torch.load(weights_only=True) does not load (a whole "
            "model or other Python objects); save model.state_dict() instead"
        )
    detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    if detail:
        return (
            f"not a file torch.load(weights_only=True) reads ({detail.group(1).strip()}): a plain pickle or another "
            "format? save the state dict with torch.save(model.state_dict(), path)"
        )
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"not a readable torch.save file (truncated or corrupt? {type(err).__name__}: {first.split('. ')[0]})"


def load_state_dict(path) -> tuple[Mapping, str]:
    """``(state dict, where)`` from a ``torch.save``'d state dict or checkpoint at ``path``
    (see :func:`find_state_dict`). Unreadable files raise ValueError (missing ones: OSError)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
        raise  # missing or unreadable path: the OS's own error names it
    except Exception as err:  # garbage bytes fail anywhere in the unpickler (KeyError, struct.error, ...), and a
        # truncated archive in the zip reader's seeks (OSError: [Errno 22] Invalid argument)
        raise ValueError(f"{os.fspath(path)}: {_why_unreadable(err)}") from err
    if not isinstance(state, Mapping):
        raise ValueError(
            f"{os.fspath(path)}: expected a state dict (name -> tensor), found {type(state).__name__}; "
            "save model.state_dict()"
        )
    return find_state_dict(state, os.fspath(path))


def _recorded(report: CheckReport, items: Iterable[tuple[str, Callable[[], torch.Tensor]]], layout: Layout,
              pattern: NMPattern | None, dim: int | None, only, complete: bool, where: str) -> None:
    seen = set()
    parts = layout.saved_as()  # file tensor -> the model's weight it is (part of), where transformers renamed it
    for name, load in items:
        whole = parts.get(name)
        canonical = layout.canonical(whole or name)
        entry = layout.weights.get(canonical)
        if entry is None:
            if selects(report, name, only):
                why = layout.dense.get(canonical) or (f"tied to {canonical}" if name in layout.tied else None)
                saved = f" ({whole} as the model holds it)" if whole else ""
                report.skipped[name] = (f"dense in the layout record{saved}: {why}" if why else
                                        "not in the layout record (a buffer, or a weight added after the save)")
            continue
        seen.add(name if whole else canonical)
        if not selects(report, name, only):
            continue
        tensor = load()
        along = entry.dim if dim is None else dim
        if whole is not None and dim is None:  # a file tensor of a weight transformers wrote in parts
            along = part_dim(entry.shape, entry.dim, tuple(tensor.shape))
            if along is None:
                report.skipped[name] = (
                    f"part of {whole} ({entry.pattern} along dim {entry.dim} of {list(entry.shape)}), written by "
                    f"transformers as {list(tensor.shape)}, which does not keep that dim whole; "
                    "nmcompile.deploy.load_pretrained(DIR) checks the weight as the model holds it")
                continue
        check_one(report, name, tensor, pattern or entry.pattern, along)
    absent = []
    for name in layout.weights:
        files = layout.saved.get(name)
        lost = [f for f in files if f not in seen] if files else ([] if name in seen else [name])
        if lost:
            absent.append(name if lost == [name] else f"{name} (written as {', '.join(lost[:3])}"
                          f"{' ...' if len(lost) > 3 else ''})")
    if complete and absent:
        renamed = "" if layout.saved else (
            "; or transformers wrote them under other names (a Mixtral's fused experts, written one Linear weight "
            "per expert) before nmcompile recorded those: load it with nmcompile.deploy.load_pretrained(DIR), which "
            "checks each weight, and save it again with nmcompile.deploy.save_pretrained")
        raise ValueError(f"{where}: the layout record names N:M weights that no weights file holds: "
                         f"{', '.join(absent[:5])}{' ...' if len(absent) > 5 else ''} (an incomplete or mixed "
                         f"directory?{renamed})")


def _unrecorded(report: CheckReport, items: Iterable[tuple[str, Callable[[], torch.Tensor]]],
                pattern: NMPattern | None, dim: int | None, only, dims: Mapping[str, int], path: str) -> None:
    pattern = pattern or NMPattern(2, 4)
    violations: dict[str, dict[int, int]] = {}
    for name, load in items:
        if not selects(report, name, only):
            continue
        tensor = load()
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
            continue
        along = dims.get(name, 1) if dim is None else dim
        check_one(report, name, tensor, pattern, along)
        if name in report and tensor.is_floating_point():
            counts = {along % tensor.dim(): report[name].violations}
            for other in (0, 1):
                if other not in counts and pattern.fits(tensor, other) is None:
                    counts[other] = masks.count_violations(tensor, pattern.n, pattern.m, other)[0]
            violations[name] = counts
    if report and not report.ok and not only:
        report.hint = suggestion(violations, pattern, 1 if dim is None else dim, path)


def check_state(state: Mapping, pattern: NMPattern | None, dim: int | None, only, layout: Layout | None = None,
                path: str = "PATH") -> CheckReport:
    """Check a state dict (packed 2:4 entries are unpacked and checked along the dim they were packed along)."""
    report = CheckReport()
    state, report.where = find_state_dict(state, "the checkpoint dict")
    dims = {name: (-1 if d == -1 else 0) for name, d in packed_dims(state).items()}
    dense = unpack_state_dict(state)
    items = [(name, (lambda t=tensor: t)) for name, tensor in dense.items()
             if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2]
    if layout is not None:
        _recorded(report, items, layout, pattern, dim, only, False, path)
    else:
        _unrecorded(report, items, pattern, dim, only, dims, path)
    packed = {key[: -len(META_SUFFIX)] for key in state if key.endswith(META_SUFFIX)}
    if packed and not _recorded_packed(state):  # a rebuilt dict: which were packed is no longer recorded
        for name in [n for n in report if not report[n].ok and n not in packed]:
            report[name] = dataclasses.replace(report[name], problem=(
                f"if it was written packed, its {META_SUFFIX} entry is missing and its values read as a dense weight "
                "of half the width (the dict has packed entries but not pack_state_dict's record of which, which a "
                "dict rebuilt by a comprehension loses); write the checkpoint again with nmcompile.deploy.pack_state_dict"))
    return report


def _recorded_packed(state: Mapping) -> bool:
    return packed_record(state) is not None


def check_path(path, pattern: NMPattern | None, dim: int | None, only) -> CheckReport:
    """Check a model directory, a safetensors file or a ``torch.save``'d state dict (see the module doc)."""
    path = os.fspath(path)
    layout = read_layout(path)
    if os.path.isdir(path):
        files = weight_files(path, required=False)
        if not files:
            packed = os.path.join(path, PACKED_FILE)
            if os.path.isfile(packed):
                return check_path(packed, pattern, dim, only)
            raise ValueError(f"{path} holds no weights file that nmcompile check reads (model.safetensors, its shards, "
                             f"or {PACKED_FILE}); check a torch.save'd state dict by its path, or a pickled model in "
                             "Python: nmcompile.check(torch.load(path, weights_only=False))")
        return _check_safetensors(files, path, pattern, dim, only, layout, complete=True)
    if path.endswith(".safetensors"):
        if not os.path.isfile(path):
            raise FileNotFoundError(2, "No such file", path)
        return _check_safetensors([path], path, pattern, dim, only, layout, complete=False)
    state, where = load_state_dict(path)
    try:
        report = check_state(state, pattern, dim, only, layout, path)
    except ValueError as err:
        raise ValueError(f"{path}{where}: {err}") from None
    report.where = where
    return report


def _check_safetensors(files, path: str, pattern, dim, only, layout: Layout | None, complete: bool) -> CheckReport:
    sources = tensor_sources(files)
    items = [(name, (lambda s=source, n=name: s.read(n))) for name, source in sources.items()
             if len(source.shape(name)) >= 2]
    report = CheckReport()
    if layout is not None:
        _recorded(report, items, layout, pattern, dim, only, complete, path)
        if complete:
            _check_codes(report, layout, os.path.dirname(files[0]), sources)
    else:
        _unrecorded(report, items, pattern, dim, only, {}, path)
    return report


def _check_codes(report: CheckReport, layout: Layout, directory: str, sources: dict) -> None:
    """The codes of the weights the record marks ``bits`` 8 or 4, against the weights files' values."""
    for bits in (8, 4):
        wanted = [name for name, w in layout.weights.items() if w.bits == bits and name in report]
        if not wanted:
            continue
        try:
            found = CodesFile(directory, layout, bits)
        except ValueError as err:
            for name in wanted:
                report[name] = dataclasses.replace(report[name], problem=str(err))
            continue
        for name in wanted:
            problem = check_against(found, name, sources[name].read(name))
            if problem:
                report[name] = dataclasses.replace(report[name], problem=problem)


# What to check instead, when a check without a layout record fails: a --dim and --only that fit the file.
# A weights file holds every weight of the model, also the dense ones, and nothing in it says along which dim a
# weight is grouped (GPT-2's Conv1D is [in, out]: dim 0).


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
