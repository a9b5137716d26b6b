"""Which kernel each finalized linear layer gets, and why: the deploy pass's per-layer decision.

:func:`qualify` applies the rules that need no timing (device, the kernel in the build or on this
CPU, dtype, shape, the weight really being 2:4); the rewrite pass then times the dense and the
sparse GEMM on the layer's real shape and keeps the sparse kernel only over the token counts where
it measured faster: on CUDA (:func:`measure`, cuSPARSELt) from ``min_tokens`` up (decoding one
token takes the dense GEMM), on a CPU (:func:`nmcompile.kernels.dispatch.cpu.measure_cpu`, the
``cpu24`` kernel, memory-bound decoding) up to ``max_tokens`` (prefill and batches take the dense
GEMM). The decision is recorded on the parameter (:func:`nmcompile.deploy_report` reads it).

The rules that need neither weights nor timing (:func:`kernel_unavailable`) and the CUDA timer
(:func:`time_cuda`) are shared with the training decisions of :mod:`.train`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import masks
from .. import cpu24
from ..deploy_op import padded_tokens, sparse_linear

__all__ = ["Decision", "qualify", "measure", "format_ratios", "RATIO_BASELINE", "kernel_unavailable", "search_unsafe", "time_cuda", "DECISION_ATTR", "MARGIN"]

DECISION_ATTR = "_nmcompile_kernel"
#: token counts tried when the graph's token count is dynamic: multiples of 8, the only dense dims
#: cuSPARSELt takes for fp16/bf16 (other counts are padded to the next one when they run)
TOKEN_LADDER = (8, 16, 64, 256, 1024, 4096)
#: cuSPARSELt's 2:4 kernels need compute capability 8.0 (Ampere) or newer; wheels built with it report
#: ``torch.backends.cusparselt.is_available()`` on older GPUs too
CUSPARSELT_MIN_CAPABILITY = (8, 0)
#: the sparse kernel must beat dense by this factor to be chosen
MARGIN = 1.02
CUSPARSELT_DTYPES = (torch.float16, torch.bfloat16)
#: cuSPARSELt 0.8.0 (torch 2.11's CUDA 13 wheels) on sm90, fp16: its algorithm search stopped an H100
#: and an H200 ("an illegal instruction", then "internal error when calling cusparseLtMatmulSearch"),
#: where the product with algorithm 0 ran right; below this version fp16 on sm90 is not searched
CUSPARSELT_SM90_FP16_SEARCH_VERSION = 801


@dataclass(frozen=True)
class Decision:
    kernel: str  # "cusparselt", "cpu24", "reference" or "dense"
    reason: str
    alg_id: int = 0
    min_tokens: int = 0  # calls with fewer rows than this take the dense GEMM
    speedup: float | None = None  # measured dense time / sparse time (CUDA: at the compiled shape; CPU: 1 token)
    max_tokens: int = -1  # calls with more rows than this take the dense GEMM (-1: none)
    isa: str = ""  # cpu24: the instruction set it runs
    ratios: tuple = ()  # cpu24: ((tokens, dense time / sparse time), ...) as measured

    @property
    def sparse(self) -> bool:
        return self.kernel != "dense"

    @property
    def graph_key(self) -> tuple:
        """What of the decision shapes the compiled graph (the reason and the timings do not: a
        decision read from the cache compiles to the graph the measured one did)."""
        return (self.kernel, self.alg_id, self.min_tokens, self.max_tokens, self.isa)

    @property
    def token_range(self) -> str:
        """The token counts that take the sparse kernel, in words."""
        if not self.sparse or self.max_tokens == 0:
            return "none"
        low = max(self.min_tokens, 1)
        return f"{low} and up" if self.max_tokens < 0 else f"{low} to {self.max_tokens}"

    def __str__(self) -> str:
        if self.ratios:  # the CPU kernel's ladder: the range, then each rung's ratio
            tokens = f"; sparse for {self.token_range} tokens, dense above" if self.sparse else ""
            if self.sparse and self.max_tokens == 0:
                tokens = "; slower than dense at every count: each call unpacks the weight for a dense GEMM"
            return (f"{self.kernel}{f' ({self.isa})' if self.isa else ''}: {self.reason}{tokens}; {RATIO_BASELINE} "
                    f"{format_ratios(self.ratios)}")
        speed = f", {self.speedup:.2f}x measured" if self.speedup else ""
        isa = f" ({self.isa})" if self.isa else ""
        tokens = f", dense below {self.min_tokens} tokens" if self.min_tokens else ""
        return f"{self.kernel}{isa}: {self.reason}{speed}{tokens}"


#: what the CPU ladder's ratios compare: the layer's dense GEMM as it would run in its place
RATIO_BASELINE = "dense F.linear time (same dtype and threads) / sparse time"


def format_ratios(ratios) -> str:
    """A measured ladder's ``(tokens, dense/sparse time)`` rungs in words: ``at 1 token: 2.41x, at 8
    tokens: 1.10x`` (never ``1:2.41x``, which reads as an N:M pattern)."""
    return ", ".join(f"at {t} token{'' if t == 1 else 's'}: {r:.2f}x" for t, r in ratios)


def qualify(
    weight: torch.Tensor, requested: str, *, device_type: str | None = None, cusparselt_available: bool | None = None,
    capability: tuple[int, int] | None = None,
) -> Decision:
    """The decision before any timing. ``requested``: ``auto``, ``dense``, ``cusparselt``, ``cpu24`` or
    ``reference``.

    ``device_type``, ``cusparselt_available`` and ``capability`` default to the weight's device, the
    running build and its GPU; tests pass them to check the CUDA rules on a CPU weight.
    """
    device_type = device_type or weight.device.type
    if capability is None and weight.device.type == "cuda":  # the weight's GPU, not the current one
        capability = torch.cuda.get_device_capability(weight.device)
    out_f, in_f = weight.shape
    if requested == "dense":
        return Decision("dense", "deploy_kernel='dense' was requested")
    bad, total = masks.count_violations(weight, 2, 4, 1)
    if bad:
        return Decision("dense", f"{bad}/{total} groups of 4 along 'in' keep more than 2: the weight is not 2:4")
    if device_type == "cpu" and requested in ("auto", "cpu24"):
        return _qualify_cpu(weight, requested)
    if requested == "cpu24":
        raise ValueError(f"deploy_kernel='cpu24' cannot be used: it is the CPU kernel and this weight is on {device_type}")
    if out_f % 16 or in_f % 16:
        return Decision("dense", f"shape [{out_f}, {in_f}] is not a multiple of 16 in both dims (2:4 kernel minimum)")
    if requested == "reference":
        return Decision("reference", "deploy_kernel='reference': packed 2:4 weight, dense GEMM (checks the rewrite)")
    why = kernel_unavailable(
        "cusparselt", device_type, weight.dtype, cusparselt_available=cusparselt_available, capability=capability
    )
    if why is not None:
        return _refuse(requested, why)
    return Decision("cusparselt", "2:4 weight, fp16/bf16, shape qualifies")


def kernel_unavailable(
    kernel: str, device_type: str, dtype: torch.dtype, *, cusparselt_available: bool | None = None,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why the GPU 2:4 ``kernel`` (``cusparselt`` or ``cutlass``) cannot run here, or None if it can.

    The rules that need no timing, shared by the deploy and the training decisions: CUDA device,
    the kernel in the build and on the GPU generation (cuSPARSELt: compute capability 8.0 or newer;
    PyTorch's CUTLASS 2:4 kernels are compiled for 8.x only), fp16/bf16. ``cusparselt_available`` and
    ``capability`` default to the running build and GPU; tests pass them.
    """
    if device_type != "cuda":
        return f"no 2:4 kernel on {device_type} ({'cuSPARSELt' if kernel == 'cusparselt' else 'CUTLASS 2:4'} is CUDA only)"
    if kernel == "cusparselt":
        if cusparselt_available is None:
            cusparselt_available = torch.backends.cusparselt.is_available()
        if not cusparselt_available:
            return "this torch build has no cuSPARSELt"
        if capability is None:
            capability = torch.cuda.get_device_capability()
        if tuple(capability) < CUSPARSELT_MIN_CAPABILITY:
            return (
                f"cuSPARSELt's 2:4 kernels need compute capability 8.0 or newer (sparse tensor cores), this GPU "
                f"is sm{capability[0]}{capability[1]}; use the dense GEMM (deploy_kernel/train_kernel 'dense' or 'auto')"
            )
    else:
        if not hasattr(torch, "_sparse_semi_structured_mm"):
            return "this torch build has no CUTLASS 2:4 ops (torch._sparse_semi_structured_mm)"
        if capability is None:
            capability = torch.cuda.get_device_capability()
        if capability[0] != 8:
            return (
                f"PyTorch's CUTLASS 2:4 kernels run on compute capability 8.x only, this GPU is "
                f"sm{capability[0]}{capability[1]}; use cusparselt"
            )
    if dtype not in CUSPARSELT_DTYPES:
        return f"{dtype} has no {kernel} 2:4 kernel here; cast the model to fp16 or bf16 (model.half()) or train under autocast"
    return None


def search_unsafe(dtype: torch.dtype, capability=None, version: int | None = None) -> str | None:
    """Why cuSPARSELt's algorithm search must not run for ``dtype`` here (the product then takes
    algorithm 0), or None. ``capability`` and ``version`` default to the current GPU and the build's
    cuSPARSELt; tests pass them."""
    if dtype != torch.float16:
        return None
    capability = tuple(capability or torch.cuda.get_device_capability())
    version = version if version is not None else torch.backends.cusparselt.version()
    if capability[0] != 9 or version is None or version >= CUSPARSELT_SM90_FP16_SEARCH_VERSION:
        return None
    return (f"algorithm 0, not searched: cuSPARSELt {version // 1000}.{version // 100 % 10}.{version % 100}'s search "
            "failed in fp16 on sm90 (an H100 and an H200), the product with algorithm 0 ran right")


def _qualify_cpu(weight: torch.Tensor, requested: str) -> Decision:
    if weight.dtype not in cpu24.DTYPES:
        return _refuse(requested, f"{weight.dtype} has no 2:4 CPU kernel (it takes fp32, bf16 and fp16)")
    if weight.shape[1] % 16:
        return _refuse(requested, f"in_features {weight.shape[1]} is not a multiple of 16 (the packed 2:4 layout's word)")
    state = cpu24.status()
    if not state.available:
        return _refuse(requested, state.reason)
    isa = cpu24.best_isa(weight.dtype)
    if requested == "cpu24":
        return Decision("cpu24", "deploy_kernel='cpu24': every token count, not timed", isa=isa)
    return Decision("cpu24", "2:4 weight, timed against dense on this CPU", isa=isa)


def _refuse(requested: str, why: str) -> Decision:
    if requested in ("cusparselt", "cpu24"):
        raise ValueError(f"deploy_kernel={requested!r} cannot be used: {why}")
    return Decision("dense", why)


def time_cuda(fn, reps: int = 20, graphs: bool = False) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (CUDA events, 3 warm-up calls).

    ``graphs=False``: each call bracketed by events, its host work included (how a graph without
    CUDA graphs runs it: cuSPARSELt builds a plan on the host at every call, about 0.4 ms with
    torch 2.11 on an H100/H200, more than many of its GEMMs take on the GPU). ``graphs=True``: the
    calls captured in one CUDA graph and replayed, GPU time alone (what ``mode="reduce-overhead"``
    runs); where capture fails, the events time it as above."""
    for _ in range(3):
        fn()
    if graphs:
        try:
            return graph_ms(fn, reps)
        except RuntimeError:
            torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(fn, reps: int, calls: int = 10) -> float:
    """GPU milliseconds per call of ``fn``: ``calls`` calls in one CUDA graph, median of ``reps // 4`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # capture needs the warm-up on a side stream
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(max(reps // 4, 3)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def measure(
    decision: Decision, weight, bias, values, tokens: int | None, in_features: int, graphs: bool = False
) -> Decision:
    """Time dense vs cuSPARSELt on this layer; keep sparse only where it is faster (CUDA only).

    ``graphs``: the compile runs under CUDA graphs (``mode="reduce-overhead"``), so GPU time decides;
    otherwise each call's host work counts too (see :func:`time_cuda`).

    ``tokens``: the layer's static token count, or None (dynamic: the :data:`TOKEN_LADDER`). Each
    count is timed as the op runs it (padded to a multiple of 8 where it is not one), with the algorithm
    searched at the largest count, which the op then uses at every count."""
    import torch.nn.functional as F


    if decision.kernel != "cusparselt":
        return decision
    w = weight.detach()
    b = None if bias is None else bias.detach()
    ladder = (tokens,) if tokens is not None else TOKEN_LADDER
    faster, speedup = [], None
    with torch.no_grad():
        # searched at the largest count as the kernel runs it (padded to cuSPARSELt's multiple), then
        # every count is timed with that algorithm, the one it will run with
        padded = torch.randn(padded_tokens(ladder[-1]), in_features, device=w.device, dtype=w.dtype)
        unsafe = search_unsafe(w.dtype, torch.cuda.get_device_capability(w.device))
        alg_id = 0 if unsafe else int(torch._cslt_sparse_mm_search(values, padded.t(), bias=b, transpose_result=True))
        for count in ladder:
            x = torch.randn(count, in_features, device=w.device, dtype=w.dtype)
            empty = values.new_empty(0, dtype=torch.int16)
            dense = time_cuda(lambda: F.linear(x, w, b), graphs=graphs)
            sparse = time_cuda(lambda: sparse_linear(x, w, values, empty, b, "cusparselt", alg_id, 0), graphs=graphs)
            faster.append(dense > MARGIN * sparse)
            speedup = dense / sparse
    how = "GPU time under CUDA graphs" if graphs else "per call, host work included; mode='reduce-overhead' times GPU alone"
    if not faster[-1]:  # slower (or within the margin) at the largest token count: never worth it
        return Decision("dense", f"cuSPARSELt measured {speedup:.2f}x of dense at {ladder[-1]} tokens ({how})", speedup=speedup)
    reason = f"{decision.reason}; timed {how.split(';')[0]}" + (f"; {unsafe}" if unsafe else "")
    return Decision("cusparselt", reason, alg_id=alg_id, min_tokens=break_even(ladder, faster), speedup=speedup)


def break_even(ladder, faster) -> int:
    """The smallest token count from which the sparse kernel was faster at every larger count (0: always)."""
    first = len(faster)
    while first > 0 and faster[first - 1]:
        first -= 1
    return ladder[first] if first > 0 else 0
