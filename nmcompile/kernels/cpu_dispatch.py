"""The CPU half of the deploy decision: time the 2:4 CPU kernel against dense on the layer's shape.

On a CPU the 2:4 kernel wins where the GEMM is memory-bound (few tokens: decoding streams every
weight once per token, and the packed weight is about half the bytes) and loses where it is
compute-bound (prefill, batches: the dense GEMM's blocking is better and the sparse one does the
same products plus the expansion). :func:`measure_cpu` times both, interleaved, on a ladder of
token counts (or the graph's static count) and keeps the sparse kernel up to the largest count
below which it was clearly faster at every rung (``max_tokens``: the slower quartile of the sparse
timings beats the faster quartile of the dense ones by the margin, so that a noisy machine's lucky
median does not pick a kernel that is slower in use); larger calls take the dense GEMM inside the
same op. Measurements are made on random weights of the layer's shape and dtype, once per
shape, thread count and ISA in a process.

Both kernels are timed with their weight out of the caches, as in a deployed model whose layers
stream from memory in turn: each call reads one of several copies of the weight, rotated so that
the copies between two reads of one copy exceed the last-level cache (:data:`COLD_BYTES`). Timed
warm, a layer whose dense and packed weights fit in L3 together measured the kernel 1.13x faster
at 64 tokens where it ran 0.92x in a model.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from . import cpu24
from .dispatch import MARGIN, Decision

__all__ = ["measure_cpu", "sparse_range", "CPU_LADDER", "time_pair", "time_series", "rotation"]

#: token counts tried when the graph's token count is dynamic
CPU_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: seconds spent timing one rung (both kernels)
RUNG_BUDGET = 0.08
#: bytes of weight copies read between two reads of one copy: twice a 32 MB last-level cache
COLD_BYTES = 64 * 2**20
#: the most copies of one weight (a layer of under 8 MB is timed partly warm)
MAX_COPIES = 8


def time_series(first, second, budget: float = RUNG_BUDGET) -> tuple[list[float], list[float]]:
    """Seconds of each call of ``first()`` and ``second()``, called alternately (so both see the same machine)."""
    for fn in (first, second):
        fn()
    start = time.perf_counter()
    first()
    second()
    once = time.perf_counter() - start
    reps = max(5, min(31, int(budget / max(once, 1e-6))))
    a, b = [], []
    for _ in range(reps):
        for fn, out in ((first, a), (second, b)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return a, b


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


def _quartiles(values: list[float]) -> tuple[float, float]:
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


@functools.lru_cache(maxsize=64)
def _ratios(out_f: int, in_f: int, dtype: torch.dtype, bias: bool, isa: str, threads: int,
            ladder: tuple[int, ...], packed_only: bool = False) -> tuple[tuple[int, float, bool], ...]:
    """``((tokens, dense / sparse median time, clearly faster), ...)`` up to the first rung where
    sparse was not clearly faster (its slower quartile within the margin of dense's faster one).

    ``packed_only``: the weight has no dense copy, so the alternative to the kernel is unpacking it
    for the call and then the dense GEMM (what ``cpu24_linear`` does above ``max_tokens``)."""
    from .. import masks
    from .packed import pack

    generator = torch.Generator().manual_seed(0)
    w = masks.prune(torch.randn(out_f, in_f, generator=generator), 2, 4, 1).to(dtype)
    b = torch.randn(out_f, generator=generator).to(dtype) if bias else None
    packed = pack(w)
    values, bits = cpu24.cpu_layout(packed.values, packed.meta)
    per_copy = values.nbytes + bits.nbytes + (0 if packed_only else w.nbytes)
    copies = [(w, values, bits)] + [(w if packed_only else w.clone(), values.clone(), bits.clone())
                                    for _ in range(min(MAX_COPIES, -(-COLD_BYTES // per_copy)) - 1)]
    op = torch.ops.nmsparse.cpu24_linear
    ratios = []
    with torch.no_grad():
        for tokens in ladder:
            x = torch.randn(tokens, in_f, generator=generator).to(dtype)
            turn = rotation(len(copies))

            def take(kernel: str):
                return copies[turn(kernel)]

            if packed_only:
                def alternative():
                    _, v, m = take("dense")
                    return op(x, v, m, b, None, out_f, 0, isa)
            else:
                def alternative():
                    return F.linear(x, take("dense")[0], b)

            def sparse_call():
                _, v, m = take("sparse")
                return op(x, v, m, b, None, out_f, -1, isa)

            dense, sparse = time_series(alternative, sparse_call)
            clear = _quartiles(dense)[0] > MARGIN * _quartiles(sparse)[1]
            ratios.append((tokens, statistics.median(dense) / statistics.median(sparse), clear))
            if not clear:
                break
    return tuple(ratios)


def sparse_range(out_f: int, in_f: int, dtype: torch.dtype, bias: bool, isa: str, ladder=CPU_LADDER,
                 packed_only: bool = False) -> tuple[int, tuple]:
    """``(max_tokens, ratios)``: the largest rung up to which the kernel was clearly faster at every
    rung (0: not even at the first), and the measured ``((tokens, median ratio), ...)``."""
    measured = _ratios(out_f, in_f, dtype, bias, isa, torch.get_num_threads(), tuple(ladder), packed_only)
    faster = [count for count, _, clear in measured if clear]
    ratios = tuple((count, ratio) for count, ratio, _ in measured)
    return (faster[-1] if faster and faster[0] == ladder[0] else 0), ratios


def measure_cpu(decision: Decision, weight: torch.Tensor, bias, tokens: int | None) -> Decision:
    """Time dense vs ``cpu24`` for this layer and keep the sparse kernel over the token counts
    where it was faster. ``tokens``: the graph's static token count, or None (dynamic)."""
    if decision.kernel != "cpu24" or decision.reason.startswith("deploy_kernel='cpu24'"):
        return decision  # forced: every token count, not timed
    ladder = CPU_LADDER if tokens is None else (max(tokens, 1),)
    out_f, in_f = weight.shape
    max_tokens, ratios = sparse_range(out_f, in_f, weight.dtype, bias is not None, decision.isa, ladder)
    if not max_tokens:
        count, ratio = ratios[0]
        return Decision("dense", f"the 2:4 CPU kernel ({decision.isa}) measured {ratio:.2f}x of dense at {count} "
                        "tokens", speedup=ratio, ratios=ratios)
    return replace(decision, max_tokens=max_tokens, speedup=ratios[0][1], ratios=ratios)
