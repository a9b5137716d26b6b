"""State dicts from files and checkpoints, for :func:`nmcompile.check`: read safely, found where nested.

A checkpoint often nests the model's state dict (``{"model": sd, "optimizer": ..., "epoch": 3}``).
:func:`find_state_dict` takes the one dict of tensors it holds, preferring the entries named
``state_dict``, ``model_state_dict`` or ``model`` when there are several (an optimizer's state is a
dict of tensors too), and raises ValueError when it cannot tell. Files are read with
``torch.load(weights_only=True)``; anything that cannot be read that way is a ValueError naming the
file and why, in one line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

__all__ = ["load_state_dict", "find_state_dict"]

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
