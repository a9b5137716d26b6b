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
shape, thread count and ISA in a process, and on disk (:mod:`.decision_cache`): a later process
with the same CPU, threads, shape, dtype, ladder and versions reads the decision instead of timing.

A rung is timed until it settles (:func:`walk`): a series whose ratio cannot be right (below what
the bytes allow, or above :data:`CEILING_RATIO`), whose quartile spreads are wider than the
ratio's distance from the margin (noise that could have gone either way), or during which the
process's threads waited for a CPU (:data:`BUSY_MAX`: a busy machine shifts every call alike) is
timed again, on every layer size and rung; a loss, which ends the ladder, is believed once two settled series say so. A
rung that never settles is left to the bytes (the kernel at one token on a layer that streams from
memory, else the ladder ends there), the decision's reason says so, and nothing is written to the
cache. With one of two cores busy, the timing once sent a layer that is 2x faster when quiet to
dense; on a lightly loaded 2-core machine, one layer's range came out 8, 16 or 256 tokens in fresh
processes, its ratios moving 10x (a dense GEMM waiting for a descheduled thread measured 36-56x).

Both kernels are timed with their weight out of the caches, as in a deployed model whose layers
stream from memory in turn: each call reads one of several copies of the weight, rotated so that
the copies between two reads of one copy exceed the last-level cache (:data:`COLD_BYTES`). Timed
warm, a layer whose dense and packed weights fit in L3 together measured the kernel 1.13x faster
at 64 tokens where it ran 0.92x in a model.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .. import cpu24
from . import cache as decision_cache
from .timing import Series, rotation, run_delay, time_pair, time_series
from . import MARGIN, Decision
from ... import masks
from ..format24 import pack

__all__ = ["measure_cpu", "sparse_range", "sparse_ladder", "measure_ladder", "Ladder", "walk", "judge", "plausible",
           "bytes_bound", "layer_timer", "max_tokens_of", "provenance", "CPU_LADDER", "CEILING_RATIO", "time_pair",
           "time_series", "Series", "run_delay", "rotation"]

#: token counts tried when the graph's token count is dynamic
CPU_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: bytes of weight copies read between two reads of one copy: twice a 32 MB last-level cache
COLD_BYTES = 64 * 2**20
#: the most copies of one weight (a layer of under 8 MB is timed partly warm)
MAX_COPIES = 8
#: the timing method's version, part of the decision cache's key: a change here re-times every shape
#: (3: a noisy rung is timed again on every layer size and route, a loss is confirmed, ratios above
#: CEILING_RATIO cannot be right, a series timed while the process waited for a CPU is not believed)
TIMING_METHOD = 3
#: times a rung whose result cannot be right (or is not settled) is timed again before the bytes decide it
RETRIES = 3
#: a loss ends the ladder (every larger count takes dense), so it is believed once this many
#: settled series of the rung say so; a clear win only moves the walk on to the next rung
CONFIRM_LOSS = 2
#: at one token (:data:`BYTES_TOKENS`) a layer of at least BYTES_MIN dense bytes streams its weight
#: from memory and the kernel reads about half of dense's bytes (:func:`bytes_bound`); a ratio below
#: PLAUSIBLE_STREAM x that bound would mean the kernel streams at under half of dense's bytes per
#: second, which no quiet measurement has shown (AVX2 on Zen 3: 0.6; AVX-512 on Sapphire Rapids:
#: 0.8-0.95). With one of two cores busy, a statically split kernel measured 0.46-0.55x there.
PLAUSIBLE_STREAM = 0.5
BYTES_MIN = 4 * 2**20
BYTES_TOKENS = 1
#: below this ratio no rung can be right (the kernel does dense's products on half the weight bytes;
#: tiny layers, where the op's fixed cost of about 10 us rules, measured 0.3-0.5x): a tiny GPT-2
#: measured 0.01x on a busy machine
ABSURD_RATIO = 0.1
#: above this ratio no rung of the compile route can be right: dense's GEMM does the kernel's products
#: on about twice its bytes, and quiet ladders measured at most 6.3x (fp32, 8 tokens, where dense's
#: small GEMM is slow) and 4.9x (bf16 on AVX2); 36-56x came from a loaded 2-core machine whose
#: statically split dense GEMM waited for a descheduled thread. Packed-only weights have no ceiling:
#: their alternative unpacks the weight for every call (measured up to 14x).
CEILING_RATIO = 10.0
#: a series whose quartile spreads (dense's and the kernel's, relative, summed) are within this is
#: quiet enough to believe even where the ratio sits near the margin (a measured tie: not clearly
#: faster); a wider one is believed only where the ratio is farther from the margin than the spread
QUIET_SPREAD = 0.1
#: a series during which this process's threads waited for a CPU more than this fraction of its wall
#: time (summed over threads) was timed on a busy machine, whatever its spread: sustained load shifts
#: every call alike (a 2-core Zen 3 at load average 6-8: the threads waited 1.7-1.9x the wall time,
#: and the kernel that is 2x faster at 2 tokens when quiet measured 4-17x there)
BUSY_MAX = 0.25


def _quartiles(values: list[float]) -> tuple[float, float]:
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


@dataclass(frozen=True)
class Ladder:
    """The rungs of one measurement, and where they come from."""

    rungs: tuple  # ((tokens, dense / sparse median time, sparse clearly faster), ...)
    source: str = "timed"  # "timed" in this process, "cached" (an earlier one), or "bytes" (see note)
    note: str = ""  # source "bytes": the timings that could not be right, which the bytes model replaced;
    #                 source "cached": the machine that measured it (CPU, host, when)
    stored: str = ""  # :func:`measure_ladder`: the decision cache file written, or "" (see not_stored)
    not_stored: str = ""  # :func:`measure_ladder`: why nothing was written ("" when it was)

    @property
    def ratios(self) -> tuple:
        return tuple((tokens, ratio) for tokens, ratio, _ in self.rungs)


def bytes_bound(dtype: torch.dtype) -> float:
    """Dense bytes over the 2:4 kernel's bytes for one weight: half the values plus a 16-bit word of
    position bits per 16 positions (fp32 1.88, bf16/fp16 1.78)."""
    size = torch.empty((), dtype=dtype).element_size()
    return size / (size / 2 + 2 / 16)


def plausible(out_f: int, in_f: int, dtype: torch.dtype, tokens: int) -> tuple[float, bool]:
    """``(floor, bytes_win)``: the lowest dense/sparse ratio at ``tokens`` that can be right, and
    whether the bytes alone make the kernel the faster one there (one token on a layer of at least
    :data:`BYTES_MIN`: it streams its weight from memory, and the kernel reads about half the bytes)."""
    dense_bytes = out_f * in_f * torch.empty((), dtype=dtype).element_size()
    if tokens <= BYTES_TOKENS and dense_bytes >= BYTES_MIN:
        return PLAUSIBLE_STREAM * bytes_bound(dtype), True
    return ABSURD_RATIO, False


def judge(tokens: int, dense: list[float], sparse: list[float], floor: float, bytes_win: bool,
          ceiling: float = math.inf):
    """``(ratio, clear, doubt)`` of one rung's timings: the median ratio, whether the sparse kernel was
    clearly faster (its slower quartile beats dense's faster one by the margin), and why the result
    cannot be right or is not settled (None when it is settled): a ratio below ``floor`` or above
    ``ceiling``, or, not clearly faster, quartile spreads wider than both :data:`QUIET_SPREAD` and
    the ratio's distance from the margin (noise that could have gone either way), on every rung.
    ``bytes_win`` no longer changes the judgement (:func:`walk` falls back to it)."""
    dense_median, sparse_median = statistics.median(dense), statistics.median(sparse)
    ratio = dense_median / sparse_median
    if ratio > ceiling:
        return ratio, False, f"{ratio:.2f}x at {tokens} tokens, above the {ceiling:.2f}x that can be right"
    (d1, d3), (s1, s3) = _quartiles(dense), _quartiles(sparse)
    if d1 > MARGIN * s3:
        return ratio, True, None
    if ratio < floor:
        return ratio, False, f"{ratio:.2f}x at {tokens} tokens, below the {floor:.2f}x that can be right"
    spread = (d3 - d1) / dense_median + (s3 - s1) / sparse_median
    distance = abs(math.log(ratio / MARGIN))
    if spread > max(QUIET_SPREAD, distance):
        return ratio, False, (f"{ratio:.2f}x at {tokens} tokens with quartile spreads ({spread:.0%} of the times) "
                              f"wider than its distance from the {MARGIN:.2f}x the decision needs")
    return ratio, False, None


def walk(ladder, measure, out_f: int, in_f: int, dtype: torch.dtype, retries: int = RETRIES,
         packed_only: bool = False) -> Ladder:
    """Time the ``ladder``'s rungs with ``measure(tokens) -> (dense seconds, sparse seconds)`` up to the
    first where sparse was not clearly faster.

    Each rung is timed until it settles: a series clearly faster (and plausible) moves the walk on;
    one that is not clearly faster ends it once :data:`CONFIRM_LOSS` settled series say so (a loss
    decides every larger count, and noise makes losses far more often than wins); a series that cannot be right or
    is not settled (:func:`judge`: below the floor, above :data:`CEILING_RATIO` on the compile route,
    spreads wider than the decision's distance; or timed while the process's threads waited for a
    CPU more than :data:`BUSY_MAX` of the time, where ``measure`` says so: a :class:`Series`) is
    timed again. A rung still unsettled after
    ``1 + retries`` series is left to the bytes (sparse where they make the kernel the faster one,
    else the ladder ends) and the ladder's source is ``"bytes"``, the reason in its note."""
    ceiling = math.inf if packed_only else CEILING_RATIO
    confirm = min(CONFIRM_LOSS, 1 + retries)
    rungs, doubts = [], []
    for tokens in ladder:
        floor, bytes_win = plausible(out_f, in_f, dtype, tokens)
        losses, seen, clear = [], [], None
        for _ in range(1 + retries):
            series = measure(tokens)
            ratio, won, doubt = judge(tokens, *series, floor, bytes_win, ceiling)
            busy = getattr(series, "busy", 0.0)
            if doubt is None and busy > BUSY_MAX:
                won, doubt = False, (f"{ratio:.2f}x at {tokens} tokens while this process's threads waited for a "
                                     f"CPU {busy:.0%} of the time (the machine was busy)")
            seen.append(doubt)
            if doubt is None and won:
                clear = True
                break
            if doubt is None:
                losses.append(ratio)
                if len(losses) >= confirm:
                    clear = False
                    break
        if clear is None:  # the series that were not losses were all doubts
            last = next(d for d in reversed(seen) if d is not None)
            if losses:
                doubts.append(f"at {tokens} tokens {len(losses)} of {len(seen)} series settled as not clearly faster "
                              f"({', '.join(f'{r:.2f}x' for r in losses)}), the others not: {last}")
            else:
                doubts.append(f"{last} ({len(seen)} times)")
            clear = bytes_win
        rungs.append((tokens, ratio, clear))
        if not clear:
            break
    return Ladder(tuple(rungs), "bytes" if doubts else "timed", "; ".join(doubts))


def layer_timer(out_f: int, in_f: int, dtype: torch.dtype, bias: bool, isa: str, packed_only: bool):
    """``measure(tokens) -> (dense seconds, sparse seconds)`` of each call, on random 2:4 weights of the
    layer's shape in rotated copies (cold, see the module's doc)."""
    generator = torch.Generator().manual_seed(0)
    w = masks.prune(torch.randn(out_f, in_f, generator=generator), 2, 4, 1).to(dtype)
    b = torch.randn(out_f, generator=generator).to(dtype) if bias else None
    packed = pack(w)
    values, bits = cpu24.cpu_layout(packed.values, packed.meta)
    per_copy = values.nbytes + bits.nbytes + (0 if packed_only else w.nbytes)
    copies = [(w, values, bits)] + [(w if packed_only else w.clone(), values.clone(), bits.clone())
                                    for _ in range(min(MAX_COPIES, -(-COLD_BYTES // per_copy)) - 1)]
    op = torch.ops.nmsparse.cpu24_linear
    turn = rotation(len(copies))  # one rotation for every series: a rung timed again goes on to the next copy

    def measure(tokens: int):
        x = torch.randn(tokens, in_f, generator=generator).to(dtype)

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

        with torch.no_grad():
            return time_series(alternative, sparse_call)

    return measure


def _key(out_f, in_f, dtype, bias, isa, threads, ladder, packed_only) -> dict:
    return decision_cache.key(out_features=out_f, in_features=in_f, dtype=dtype, bias=bias, isa=isa, threads=threads,
                              ladder=ladder, packed_only=packed_only, method=TIMING_METHOD)


def measure_ladder(out_f: int, in_f: int, dtype: torch.dtype, bias: bool, isa: str, ladder=CPU_LADDER,
                   packed_only: bool = False, keep_out: str | None = None) -> Ladder:
    """Time the ladder now, at the current thread count, and write it to the decision cache when it
    could be trusted (never when the bytes model decided a rung, nor when ``keep_out`` says why not). The
    ladder says what was written (``stored``, the file) or why nothing was (``not_stored``)."""
    measured = walk(tuple(ladder), layer_timer(out_f, in_f, dtype, bias, isa, packed_only), out_f, in_f, dtype,
                    packed_only=packed_only)
    if measured.source != "timed" or keep_out:
        return replace(measured, not_stored=keep_out or provenance(measured))
    path, why = decision_cache.try_store(
        _key(out_f, in_f, dtype, bias, isa, torch.get_num_threads(), tuple(ladder), packed_only), measured.rungs)
    return replace(measured, stored=str(path) if path else "", not_stored=why)


@functools.lru_cache(maxsize=64)
def _ratios(out_f: int, in_f: int, dtype: torch.dtype, bias: bool, isa: str, threads: int,
            ladder: tuple[int, ...], packed_only: bool = False) -> Ladder:
    """The :class:`Ladder` up to the first rung where sparse was not clearly faster: from the decision
    cache where an earlier process (or ``nmcompile tune``) measured this key, else timed now.

    ``packed_only``: the weight has no dense copy, so the alternative to the kernel is unpacking it
    for the call and then the dense GEMM (what ``cpu24_linear`` does above ``max_tokens``)."""
    cached = decision_cache.load_entry(_key(out_f, in_f, dtype, bias, isa, threads, ladder, packed_only))
    if cached is not None:
        return Ladder(cached.rungs, "cached", cached.machine)
    return measure_ladder(out_f, in_f, dtype, bias, isa, ladder, packed_only)


def sparse_ladder(out_f: int, in_f: int, dtype: torch.dtype, bias: bool, isa: str, ladder=CPU_LADDER,
                  packed_only: bool = False) -> tuple[int, Ladder]:
    """``(max_tokens, ladder)``: the largest rung up to which the kernel was clearly faster at every
    rung (0: not even at the first), and the :class:`Ladder` that says so."""
    measured = _ratios(out_f, in_f, dtype, bias, isa, torch.get_num_threads(), tuple(ladder), packed_only)
    return max_tokens_of(measured), measured


def max_tokens_of(measured: Ladder) -> int:
    """The largest rung up to which the kernel was clearly faster at every rung (0: not at the first)."""
    rung = 0
    for count, _, clear in measured.rungs:
        if not clear:
            break
        rung = count
    return rung


def sparse_range(out_f: int, in_f: int, dtype: torch.dtype, bias: bool, isa: str, ladder=CPU_LADDER,
                 packed_only: bool = False) -> tuple[int, tuple]:
    """``(max_tokens, ratios)``: :func:`sparse_ladder`'s range and its ``((tokens, median ratio), ...)``."""
    max_tokens, measured = sparse_ladder(out_f, in_f, dtype, bias, isa, ladder, packed_only)
    return max_tokens, measured.ratios


def provenance(measured: Ladder) -> str:
    """How a ladder was decided, for a decision's reason ("" when timed in this process)."""
    if measured.source == "cached":
        return f"measured by an earlier process on {measured.note} (decision cache in {decision_cache.cache_root()})"
    if measured.source == "bytes":
        return f"the bytes decide, the timings could not be right: {measured.note}"
    return ""


def measure_cpu(decision: Decision, weight: torch.Tensor, bias, tokens: int | None) -> Decision:
    """Time dense vs ``cpu24`` for this layer (or read an earlier process's timing) and keep the sparse
    kernel over the token counts where it was faster. ``tokens``: the graph's static token count, or
    None (dynamic)."""
    if decision.kernel != "cpu24" or decision.reason.startswith("deploy_kernel='cpu24'"):
        return decision  # forced: every token count, not timed
    ladder = CPU_LADDER if tokens is None else (max(tokens, 1),)
    out_f, in_f = weight.shape
    max_tokens, measured = sparse_ladder(out_f, in_f, weight.dtype, bias is not None, decision.isa, ladder)
    how = provenance(measured)
    ratios = measured.ratios
    speedup = None if measured.source == "bytes" else ratios[0][1]
    if not max_tokens:
        count, ratio = ratios[0]
        reason = f"the 2:4 CPU kernel ({decision.isa}) measured {ratio:.2f}x of dense at {count} tokens"
        return Decision("dense", f"{reason}; {how}" if how else reason, speedup=speedup, ratios=ratios)
    reason = f"{decision.reason}; {how}" if how else decision.reason
    return replace(decision, reason=reason, max_tokens=max_tokens, speedup=speedup, ratios=ratios)
