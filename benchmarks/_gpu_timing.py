"""GPU timing helpers for nmcompile's benchmarks: interleaved CUDA-event medians and an environment line.

Every variant of one measurement runs in the same process, round-robin (the order rotates each
round), so clock changes and host noise hit all variants alike. In :func:`time_interleaved` each
call is bracketed by CUDA events with no synchronization in between, so a call's time is GPU time
when the GPU is the bottleneck and includes launch overhead when the host is (decode-sized shapes):
what a caller sees. :func:`time_synchronized` (training steps, any device) waits for the device
before and after each call and reads the host clock: a step's whole wall time, its host syncs and
launches included, with every sample kept (medians, means, paired ratios).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch


def env_info() -> dict:
    """Device, torch, CUDA and cuSPARSELt versions (cuSPARSELt 0.8.0 had Hopper regressions fixed in 0.8.1)."""
    cusparselt = torch.backends.cusparselt.version() if torch.backends.cusparselt.is_available() else None
    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "capability": f"sm{props.major}{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cusparselt": cusparselt,
    }


def short_error(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:160]}"


def time_interleaved(
    fns: dict[str, Callable[[], object]], *, reps: int, warmup: int, inference: bool = True
) -> dict[str, float | str]:
    """Median milliseconds per call of every function in ``fns``, or the error string of one that failed.

    Runs under ``torch.inference_mode()`` unless ``inference=False`` (training steps, which call
    backward). A function that raises during warm-up is dropped from the timed rounds and reported
    by its error; the others still run.
    """
    with torch.inference_mode() if inference else contextlib.nullcontext():
        live, results = _warm(fns, warmup, torch.cuda.synchronize)
        names = list(live)
        events: dict[str, list] = {name: [] for name in names}
        for rep in range(reps if names else 0):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                live[name]()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize()
    for name in names:
        results[name] = statistics.median(s.elapsed_time(e) for s, e in events[name])
    return results


def _warm(fns: dict[str, Callable[[], object]], warmup: int, sync: Callable[[], None]):
    """``(functions that ran warmup times, {name: error} of those that raised)``."""
    live: dict[str, Callable[[], object]] = {}
    errors: dict[str, float | str] = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            sync()
            live[name] = fn
        except Exception as exc:  # recorded in the table, the other variants still run
            sync()
            errors[name] = short_error(exc)
    return live, errors


def time_synchronized(
    fns: dict[str, Callable[[], object]], *, reps: int, warmup: int, device: str = "cuda"
) -> dict[str, list[float] | str]:
    """Milliseconds of every call of every function in ``fns`` (``reps`` each, round-robin, the order
    rotating each round; round ``i`` of every function is its ``i``-th sample), or the error string
    of one that raised during warm-up. The device is synchronised before and after each call (a
    no-op on the CPU), and the host clock read around it."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    live, results = _warm(fns, warmup, sync)
    names = list(live)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps if names else 0):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            sync()
            start = time.perf_counter()
            live[name]()
            sync()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {**results, **samples}


def cell(value: float | str | None, dense: float | str | None = None) -> str:
    """``"1.234"`` or ``"0.617 (2.00x)"`` against ``dense``; errors shortened for a table cell."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value.replace("|", "/")[:60]
    text = f"{value:.3f}"
    if isinstance(dense, float) and value > 0:
        text += f" ({dense / value:.2f}x)"
    return text
