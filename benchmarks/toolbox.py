"""What the benchmark scripts share: interleaved timing, resident memory, the machine line, GPU timers.

Timing. Every variant of one measurement runs in the same process, round-robin, each round starting
one variant later (:func:`rotation`), so that clock changes and host noise hit all variants alike and
no variant always follows the same one (and finds the caches as that one left them). On the CPU:
:func:`interleaved` (median seconds, rounds sized to a time budget) and :func:`interleaved_samples`
(every call's seconds: medians, means, paired ratios). On a GPU: :func:`time_interleaved` (CUDA
events around each call, no synchronisation in between: GPU time where the GPU is the bottleneck,
launch overhead included where the host is, as a caller sees it), :func:`time_synchronized` (the
device synchronised around each call, host clock: a training step's whole wall time) and
:func:`graph_ms` (calls captured in one CUDA graph and replayed: GPU time alone). nmcompile's own
timers are what the compile-time decisions use: ``nmcompile.kernels.dispatch.cpu.time_pair`` (two
kernels alternately, on the CPU) and ``nmcompile.kernels.dispatch.time_cuda``; :func:`graph_ms` is
built on the latter, and a script that times exactly two functions the way the dispatch does calls
``time_pair`` itself.

Memory: :func:`resident_mb` and :func:`peak_mb` read ``VmRSS`` and ``VmHWM`` from /proc/self/status
(see :func:`status_mb` for why not ``ru_maxrss``).

The machine: :func:`cpu_name`, :func:`machine` (the dict the CPU scripts record), :func:`bandwidth`
(the read-bandwidth probe), :func:`busy_loop` (another user's job on one core), :func:`gpu_env`.

A script in a subfolder imports this as ``benchmarks.toolbox`` (and a sibling as
``benchmarks.<group>.<script>``): run as a file, it first appends the repository root to
``sys.path``, after ``PYTHONPATH``, so that a tree put first there (an A/B run of two builds) still
provides nmcompile.
"""

from __future__ import annotations

import contextlib
import math
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

#: the repository root, and the folder the scripts write their raw outputs to by default
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


# ----------------------------------------------------------------------------- timing


def rotation(names: Iterable[str], rounds: int) -> Iterator[str]:
    """The names in the order of ``rounds`` round-robin rounds, each round starting one name later."""
    names = list(names)
    for rep in range(rounds if names else 0):
        shift = rep % len(names)
        yield from names[shift:] + names[:shift]


def interleaved_samples(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
                        sync: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds of every call of every function in ``fns``: ``warmup`` untimed calls of each, then
    ``rounds`` rotated rounds (round ``i`` of every function is its ``i``-th sample). ``sync`` (e.g.
    ``torch.cuda.synchronize``) is called before and after each timed call."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    if sync is not None:
        sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for name in rotation(fns, rounds):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fns[name]()
        if sync is not None:
            sync()
        samples[name].append(time.perf_counter() - start)
    return samples


def interleaved(fns: dict[str, Callable[[], object]], budget: float = 1.0, min_reps: int = 5, max_reps: int = 41,
                warm: bool = True) -> dict[str, float]:
    """Median seconds of each function, called in rotated round-robin rounds: as many rounds as fit
    ``budget`` seconds (one round timed after a warm-up call of each), between ``min_reps`` and
    ``max_reps``. ``warm=False``: the caller has already called each function (a model's generate
    taking tens of seconds): no warm-up, ``min_reps`` rounds."""
    if warm:
        for fn in fns.values():
            fn()
        start = time.perf_counter()
        for fn in fns.values():
            fn()
        once = time.perf_counter() - start
        reps = max(min_reps, min(max_reps, int(budget / max(once, 1e-6))))
    else:
        reps = min_reps
    samples = interleaved_samples(fns, reps, warmup=0)
    return {name: statistics.median(t) for name, t in samples.items()}


# ----------------------------------------------------------------------------- GPU timing


def short_error(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` (160 characters at most), for a table cell or a row."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:160]}"


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


def time_interleaved(fns: dict[str, Callable[[], object]], *, reps: int, warmup: int,
                     inference: bool = True) -> dict[str, float | str]:
    """Median milliseconds per call of every function in ``fns`` on the GPU, each call bracketed by
    CUDA events with no synchronisation in between, or the error string of one that failed.

    Runs under ``torch.inference_mode()`` unless ``inference=False`` (training steps, which call
    backward). A function that raises during warm-up is dropped from the timed rounds and reported
    by its error; the others still run."""
    with torch.inference_mode() if inference else contextlib.nullcontext():
        live, results = _warm(fns, warmup, torch.cuda.synchronize)
        events: dict[str, list] = {name: [] for name in live}
        for name in rotation(live, reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            live[name]()
            end.record()
            events[name].append((start, end))
        torch.cuda.synchronize()
    for name in live:
        results[name] = statistics.median(s.elapsed_time(e) for s, e in events[name])
    return results


def time_synchronized(fns: dict[str, Callable[[], object]], *, reps: int, warmup: int,
                      device: str = "cuda") -> dict[str, list[float] | str]:
    """Milliseconds of every call of every function in ``fns`` (``reps`` each, rotated rounds; round
    ``i`` of every function is its ``i``-th sample), or the error string of one that raised during
    warm-up. The device is synchronised before and after each call (nothing to wait for on the
    CPU), and the host clock read around it."""
    cuda = torch.device(device).type == "cuda"
    live, results = _warm(fns, warmup, torch.cuda.synchronize if cuda else (lambda: None))
    samples = interleaved_samples(live, reps, warmup=0, sync=torch.cuda.synchronize if cuda else None)
    return {**results, **{name: [s * 1e3 for s in t] for name, t in samples.items()}}


def graph_ms(fn: Callable[[], object], reps: int = 20) -> tuple[float, str]:
    """GPU milliseconds per call under CUDA graph replay (nmcompile's own timer, what
    ``mode="reduce-overhead"`` runs), and ``"graph"``; where capture fails, the eager time (CUDA
    events around each call) and why."""
    from nmcompile.kernels import dispatch

    for _ in range(3):
        fn()
    try:
        return dispatch.graph_ms(fn, reps), "graph"
    except RuntimeError as exc:
        torch.cuda.synchronize()
        return dispatch.time_cuda(fn, reps=reps, graphs=False), f"eager (capture failed: {short_error(exc)})"


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


# ----------------------------------------------------------------------------- memory


def status_mb(field: str) -> float:
    """MiB of ``field`` of this process in /proc/self/status (Linux; NaN where there is none).

    ``VmRSS`` is the resident memory now; ``VmHWM`` its highest since the process started (or since
    :func:`reset_peak`). Not ``resource.getrusage(...).ru_maxrss``: Linux folds the old memory map's
    peak into it at ``exec``, so a process started by a large one (a benchmark's child, the CLI in a
    subprocess) reads at least its parent's resident memory at the fork. ``VmHWM`` belongs to the
    process's own memory map, which ``exec`` replaces."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def resident_mb() -> float:
    """Resident memory of this process now, MiB (``VmRSS``)."""
    return status_mb("VmRSS")


def peak_mb() -> float:
    """The highest resident memory of this process, MiB (``VmHWM``)."""
    return status_mb("VmHWM")


def reset_peak() -> None:
    """Start :func:`peak_mb` again from the resident memory now (Linux's ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ----------------------------------------------------------------------------- the machine


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSON-lines results file (none where it does not exist yet)."""
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def append_row(path: str | os.PathLike, row: dict, echo: bool = True) -> None:
    """Append ``row`` to a JSON-lines results file (and print it on stderr, so a log shows progress)."""
    if echo:
        print(json.dumps(row), file=sys.stderr)
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine() or "unknown"


def commit(path: str | os.PathLike | None = None) -> str:
    """The short commit of the git checkout holding ``path`` (default: the nmcompile imported here),
    empty where it is not one."""
    if path is None:
        import nmcompile

        path = Path(nmcompile.__file__).parent
    done = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


def machine() -> dict:
    """The machine line the CPU scripts record: CPU, threads, torch, the 2:4 kernel's ISAs, nmcompile's commit."""
    from nmcompile.kernels import cpu24

    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__, "isa": cpu24.isas(),
            "nmcompile": commit()}


def bandwidth() -> float:
    """The machine's read bandwidth now, GB/s: ``torch.sum`` over a 512 MB fp32 buffer (far larger
    than the caches), median of 9."""
    buf = torch.ones(128 * 1024 * 1024)
    times = []
    for _ in range(9):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * 4 / statistics.median(times) / 1e9


BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def busy_loop(core: int) -> subprocess.Popen:
    """A process spinning on ``core`` (another user's job); the caller kills it."""
    return subprocess.Popen([sys.executable, "-c", BUSY, str(core)])


def gpu_env() -> dict:
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
