"""The CPU dispatch's measured decisions, kept on disk so that a later process decides without timing.

Timing the 2:4 kernel against dense at compile time costs every process (each server start) the
time again, and a busy machine measures wrong. A measurement that could be trusted is written
here, keyed by everything that decides it: the CPU model and the ISA the kernel runs, threads,
dtype, shape, bias, the token ladder, whether the weight is held packed only, the kernel's build
(its sources, flags and torch), the nmcompile and torch versions and the timing method's version
(as Inductor's autotune cache keys its choices). ``nmcompile tune DIR`` fills it for a model's
shapes on a quiet machine.

Where: ``$NMCOMPILE_CACHE_DIR``, else ``$XDG_CACHE_HOME/nmcompile``, else ``~/.cache/nmcompile``;
one JSON file per key under ``cpu24/``, written whole (a temporary file renamed over the old one).
``NMCOMPILE_DECISION_CACHE=off`` (or ``0``, ``false``, ``no``) turns it off: every process times
anew and writes nothing. A file that cannot be read, is damaged (bytes that are not UTF-8 or not JSON
included) or does not hold its key is a miss with one warning (and replaced by the next measurement);
a cache folder that cannot be written is a warning, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import tempfile
import warnings
from pathlib import Path
from ...version import __version__
from .. import cpu24

__all__ = ["cache_root", "enabled", "key", "load", "store", "try_store", "path_of", "cpu_model", "DIR_ENV", "SWITCH_ENV"]

DIR_ENV = "NMCOMPILE_CACHE_DIR"
SWITCH_ENV = "NMCOMPILE_DECISION_CACHE"
#: the layout of a cache file; a change makes older files unreadable as keys (they no longer match)
FORMAT = 1
_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes")


def enabled() -> bool:
    """Whether decisions are read from and written to disk (:data:`SWITCH_ENV`)."""
    value = os.environ.get(SWITCH_ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{SWITCH_ENV}={os.environ[SWITCH_ENV]!r} is not understood; set it to 'off' (or 0, false, "
                     "no) to time every process anew, or unset it (or 'on') to keep measured decisions on disk")


def cache_root() -> Path:
    """The folder of nmcompile's caches (:data:`DIR_ENV`, else the XDG cache folder)."""
    explicit = os.environ.get(DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "nmcompile"


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def key(*, out_features: int, in_features: int, dtype, bias: bool, isa: str, threads: int, ladder, packed_only: bool,
        method: int) -> dict:
    """What decides a CPU dispatch measurement (``method``: the timing method's version)."""
    import torch


    return {
        "format": FORMAT, "cpu": cpu_model(), "isa": isa, "threads": int(threads), "dtype": str(dtype).replace("torch.", ""),
        "shape": [int(out_features), int(in_features)], "bias": bool(bias), "ladder": [int(t) for t in ladder],
        "packed_only": bool(packed_only), "kernel": cpu24.library_name(), "method": int(method),
        "nmcompile": __version__, "torch": torch.__version__,
    }


def path_of(entry_key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(entry_key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_root() / "cpu24" / f"{digest}.json"


def load(entry_key: dict):
    """The rungs stored under ``entry_key`` (``((tokens, ratio, clearly faster), ...)``), or None: a miss
    where there is no file, and a miss with one warning where the file cannot be read or is not a
    valid entry for this key (damaged bytes, not UTF-8, not JSON, another key, rungs that are not the
    key's ladder)."""
    if not enabled():
        return None
    path = path_of(entry_key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        warnings.warn(f"nmcompile: cannot read the decision cache file {path} ({err}); timing this layer instead",
                      stacklevel=2)
        return None
    try:
        rungs = _rungs_of(json.loads(data.decode("utf-8")), entry_key)
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        warnings.warn(f"nmcompile: ignoring the decision cache file {path}: it is not a valid entry "
                      f"({type(err).__name__}: {str(err)[:200]}); the layer is timed again and the file replaced "
                      "(delete it, or the folder, to clear the cache)", stacklevel=2)
        return None
    return rungs


def _rungs_of(entry, entry_key: dict) -> tuple:
    if not isinstance(entry, dict) or entry.get("key") != entry_key:
        raise ValueError("it holds another key")
    rungs = tuple((int(t), float(r), c) for t, r, c in entry["rungs"])
    if not rungs:
        raise ValueError("no rung")
    ladder = tuple(entry_key.get("ladder", ()))
    if tuple(t for t, _, _ in rungs) != ladder[:len(rungs)]:
        raise ValueError(f"its token counts {[t for t, _, _ in rungs]} are not the key's ladder {list(ladder)}")
    if not all(math.isfinite(r) and r > 0 and isinstance(c, bool) for _, r, c in rungs):
        raise ValueError("a rung's ratio is not a positive number or its verdict not true/false")
    return rungs


def store(entry_key: dict, rungs, source: str = "measured") -> Path | None:
    """Write ``rungs`` under ``entry_key`` (whole: a temporary file renamed); the file, or None when off
    or the folder cannot be written (a warning)."""
    return try_store(entry_key, rungs, source)[0]


def try_store(entry_key: dict, rungs, source: str = "measured") -> tuple[Path | None, str]:
    """:func:`store`, and why nothing was written (``""`` when the file was): ``(file, "")`` or
    ``(None, why)``. A folder that cannot be written is also a warning."""
    if not enabled():
        return None, f"the decision cache is off ({SWITCH_ENV}={os.environ.get(SWITCH_ENV, '')})"
    path = path_of(entry_key)
    entry = {"key": entry_key, "rungs": [[int(t), float(r), bool(c)] for t, r, c in rungs], "source": source}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        warnings.warn(f"nmcompile: cannot write the decision cache at {path.parent} ({err}); set {DIR_ENV} to a "
                      f"writable folder, or {SWITCH_ENV}=off to stop trying", stacklevel=3)
        return None, f"cannot write {path.parent} ({err.strerror or err})"
    return path, ""
