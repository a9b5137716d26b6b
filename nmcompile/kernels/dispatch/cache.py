"""The CPU dispatch's measured decisions, kept on disk so that a later process decides without timing.

Timing the 2:4 kernel against dense at compile time costs every process (each server start) the
time again, and a busy machine measures wrong. A measurement that could be trusted is written
here, keyed by everything that decides it: the CPU (model name, vendor, family, model, stepping and
ISA flags, :func:`cpu_identity`: one model name can cover several microarchitectures) and the ISA
the kernel runs, threads, dtype, shape, bias, the token ladder, whether the weight is held packed
only, the kernel's build (its sources, flags and torch), the nmcompile and torch versions and the
timing method's version (as Inductor's autotune cache keys its choices). Each file also says which
host wrote it and when, for the decision's reason. ``nmcompile tune DIR`` fills it for a model's
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
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from ...version import __version__
from .. import cpu24

__all__ = ["cache_root", "enabled", "key", "load", "store", "try_store", "path_of", "cpu_model", "cpu_identity", "parse_cpuinfo", "describe_cpu", "load_entry", "Entry", "ISA_FLAGS", "DIR_ENV", "SWITCH_ENV"]

DIR_ENV = "NMCOMPILE_CACHE_DIR"
SWITCH_ENV = "NMCOMPILE_DECISION_CACHE"
#: the layout of a cache file and its key; a change makes older files misses (their keys no longer
#: match). 2: the CPU named by vendor, family, model, stepping and ISA flags, not its model name alone
FORMAT = 2
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


#: the ``/proc/cpuinfo`` flags that decide how fast the kernel or the dense GEMM it is timed against
#: runs: the kernel's ISAs (AVX2+FMA+F16C; AVX-512 F/BW/VL; VBMI2+BF16) and what oneDNN and MKL use
#: beyond them (AVX-512 DQ/VNNI/FP16, AVX-VNNI, AMX)
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vbmi2",
             "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def parse_cpuinfo(text: str) -> dict:
    """``{vendor, family, model, stepping, name, flags}`` of the first processor in ``text`` (the
    contents of ``/proc/cpuinfo``); ``flags``: the sorted :data:`ISA_FLAGS` it has. Where the text
    names no vendor (no ``/proc/cpuinfo``: not Linux), the platform's words and the ISAs the kernel
    found by CPUID stand in."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block only
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    if "vendor_id" not in fields:
        return {"vendor": platform.machine() or "unknown", "family": "", "model": "", "stepping": "",
                "name": platform.processor() or platform.machine() or "unknown", "flags": sorted(cpu24.isas())}
    have = set(fields.get("flags", "").split())
    return {"vendor": fields["vendor_id"], "family": fields.get("cpu family", ""), "model": fields.get("model", ""),
            "stepping": fields.get("stepping", ""), "name": fields.get("model name", ""),
            "flags": sorted(f for f in ISA_FLAGS if f in have)}


@functools.lru_cache(maxsize=1)
def cpu_identity() -> dict:
    """This CPU as the cache key names it (:func:`parse_cpuinfo` of ``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    return parse_cpuinfo(text)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    return cpu_identity()["name"] or platform.processor() or platform.machine() or "unknown"


def describe_cpu(identity: dict) -> str:
    """``AMD EPYC (AuthenticAMD family 25 model 1 stepping 1; avx avx2 f16c fma)``."""
    where = " ".join(f"{k} {identity[k]}" for k in ("family", "model", "stepping") if identity.get(k))
    return f"{identity.get('name') or 'unknown'} ({identity.get('vendor', 'unknown')}{' ' + where if where else ''}; " \
           f"{' '.join(identity.get('flags', ())) or 'no AVX'})"


def key(*, out_features: int, in_features: int, dtype, bias: bool, isa: str, threads: int, ladder, packed_only: bool,
        method: int) -> dict:
    """What decides a CPU dispatch measurement (``method``: the timing method's version). The CPU is
    named by its model name, vendor, family, model, stepping and ISA flags (:func:`cpu_identity`):
    one model name ("AMD EPYC") covers a Zen 5 with AVX-512 and a Zen 3 with AVX2."""
    import torch


    identity = cpu_identity()
    return {
        "format": FORMAT, "cpu": cpu_model(),
        "cpu_id": [identity["vendor"], identity["family"], identity["model"], identity["stepping"]],
        "cpu_flags": list(identity["flags"]), "isa": isa, "threads": int(threads),
        "dtype": str(dtype).replace("torch.", ""),
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
    entry = load_entry(entry_key)
    return None if entry is None else entry.rungs


@dataclass(frozen=True)
class Entry:
    rungs: tuple  # ((tokens, ratio, clearly faster), ...)
    machine: str  # the CPU that measured it, its host and when (:func:`describe_cpu`)


def load_entry(entry_key: dict) -> Entry | None:
    """:func:`load`, with the machine that measured the entry."""
    if not enabled():
        return None
    path = path_of(entry_key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        warnings.warn(f"nmcompile: cannot read the decision cache file {path} ({err}); timing this layer instead",
                      stacklevel=3)
        return None
    try:
        entry = json.loads(data.decode("utf-8"))
        rungs = _rungs_of(entry, entry_key)
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        warnings.warn(f"nmcompile: ignoring the decision cache file {path}: it is not a valid entry "
                      f"({type(err).__name__}: {str(err)[:200]}); the layer is timed again and the file replaced "
                      "(delete it, or the folder, to clear the cache)", stacklevel=3)
        return None
    cpu_id = entry_key.get("cpu_id") or ["", "", "", ""]
    identity = dict(zip(("vendor", "family", "model", "stepping"), cpu_id), name=entry_key.get("cpu", ""),
                    flags=entry_key.get("cpu_flags", ()))
    host = entry.get("host") if isinstance(entry.get("host"), str) else ""
    when = entry.get("written") if isinstance(entry.get("written"), str) else ""
    return Entry(rungs, describe_cpu(identity) + (f", host {host}" if host else "") + (f", {when}" if when else ""))


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
    entry = {"key": entry_key, "rungs": [[int(t), float(r), bool(c)] for t, r, c in rungs], "source": source,
             "host": platform.node(), "written": time.strftime("%Y-%m-%d %H:%M:%S %z")}
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
