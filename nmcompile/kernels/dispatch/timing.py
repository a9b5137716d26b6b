"""Timing two kernels against each other on a machine that may be shared: calls alternated so that both see
the same machine, and how long this process's threads waited for a CPU meanwhile (Linux's schedstat), so that a
series timed on a busy machine can be told apart. Used by the CPU deploy decision (:mod:`.cpu`).
"""

from __future__ import annotations

import os
import statistics
import time

__all__ = ["RUNG_BUDGET", "Series", "run_delay", "time_series", "time_pair", "rotation"]

#: seconds spent timing one rung (both kernels)
RUNG_BUDGET = 0.08


class Series(tuple):
    """``(dense seconds, sparse seconds)`` of one series of calls, and ``busy``: the seconds this
    process's threads waited for a CPU during it (summed over threads, :func:`run_delay`) over its
    wall time; 0 where unknown."""

    def __new__(cls, first, second, busy: float = 0.0):
        series = super().__new__(cls, (first, second))
        series.busy = float(busy)
        return series


def run_delay() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed (Linux's
    ``/proc/self/task/*/schedstat``); None where the kernel keeps no such count."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    total, read = 0, False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
            read = True
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9 if read else None


def time_series(first, second, budget: float = RUNG_BUDGET) -> Series:
    """Seconds of each call of ``first()`` and ``second()``, called alternately (so both see the same
    machine), and how much of the series this process's threads waited for a CPU (:class:`Series`)."""
    for fn in (first, second):
        fn()
    start = time.perf_counter()
    first()
    second()
    once = time.perf_counter() - start
    reps = max(5, min(31, int(budget / max(once, 1e-6))))
    a, b = [], []
    waited, began = run_delay(), time.perf_counter()
    for _ in range(reps):
        for fn, out in ((first, a), (second, b)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    wall, after = time.perf_counter() - began, run_delay()
    busy = (after - waited) / wall if waited is not None and after is not None and wall > 0 else 0.0
    return Series(a, b, busy=max(busy, 0.0))


def time_pair(first, second, budget: float = RUNG_BUDGET) -> tuple[float, float]:
    """Median seconds of ``first()`` and ``second()``, called alternately."""
    a, b = time_series(first, second, budget)
    return statistics.median(a), statistics.median(b)


def rotation(copies: int):
    """``turn(kernel) -> index``: the copy of the weight each next call of ``"dense"`` or
    ``"sparse"`` reads. Each kernel steps through all copies in turn, about half a cycle apart, so
    that, with the kernels called alternately and three or more copies, no call reads the copy that
    the call before it read (where both kernels read the packed copy: ``packed_only``)."""
    at = {"dense": 0, "sparse": (copies + 1) // 2}

    def turn(kernel: str) -> int:
        at[kernel] = (at[kernel] + 1) % copies
        return at[kernel]

    return turn
