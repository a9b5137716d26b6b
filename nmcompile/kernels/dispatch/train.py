"""Which kernel each training GEMM of a weight gets (forward, DGRAD, WGRAD), and why.

The ``train_kernel`` option asks for ``auto`` (default), ``dense``, ``cusparselt``, ``cutlass`` or
``reference``. Per GEMM, :func:`decide` applies, in order:

1. the recipe: the GEMM's operand must be 2:4 by construction (the forward weight along ``in``,
   the DGRAD weight along ``out``, MVUE24's output gradient along the tokens); otherwise dense,
   with the recipe's reason, whatever was asked;
2. the device rules of :func:`nmcompile.kernels.dispatch.kernel_unavailable` (CUDA, the kernel
   in the build or GPU, fp16/bf16): ``auto`` takes cuSPARSELt where they hold and dense where
   not; a forced kernel that cannot run raises :class:`TrainKernelError` naming the layer;
3. the kernel's shape alignment (:data:`nmcompile.kernels.train_gemms.ALIGNMENT`): dense where a
   static shape does not fit (as the deploy decision does); with a dynamic token count a forced
   kernel checks each call, ``auto`` stays dense (it times static shapes only);
4. under ``auto``, :func:`measure`: the compressing sparse GEMM timed against the dense one on the
   layer's shapes, sparse kept only where it was faster by :data:`~.dispatch.MARGIN`.

The decisions of one weight form a :class:`TrainKernels`, kept in the weight's record
(``WeightAnnotation.kernels``) and read by :func:`nmcompile.training.train_report`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import MARGIN, Decision, kernel_unavailable, time_cuda
from ..train_gemms import ALIGNMENT, misaligned
from ..train_gemms import sparse24_mm
from ... import masks

__all__ = ["ROLES", "TrainKernels", "TrainKernelError", "decide", "measure", "all_dense"]

ROLES = ("forward", "dgrad", "wgrad")


class TrainKernelError(ValueError):
    """A forced ``train_kernel`` cannot run a layer's GEMM (device, build, dtype)."""


@dataclass(frozen=True)
class TrainKernels:
    """The kernel of each training GEMM of one weight."""

    forward: Decision
    dgrad: Decision
    wgrad: Decision

    @property
    def sparse(self) -> bool:
        return any(d.sparse for d in (self.forward, self.dgrad, self.wgrad))

    def as_dict(self) -> dict[str, Decision]:
        return {role: getattr(self, role) for role in ROLES}

    def __str__(self) -> str:
        return "; ".join(f"{role} {decision}" for role, decision in self.as_dict().items())


def all_dense(reason: str) -> TrainKernels:
    """Every GEMM of a weight dense for one reason (a convolution, a stacked expert weight, ...)."""
    return TrainKernels(*(Decision("dense", reason) for _ in ROLES))


def decide(
    requested: str, role: str, *, layer: str, not_24: str | None, rows: int, cols: int | None, n: int | None,
    dtype: torch.dtype, device_type: str, cusparselt_available: bool | None = None,
    capability: tuple[int, int] | None = None,
) -> Decision:
    """The kernel of ``layer``'s ``role`` GEMM: a 2:4 operand ``[rows, cols]`` times a dense ``[cols, n]``.

    ``not_24``: why the recipe does not make the operand 2:4 (None: it does). ``cols``/``n`` are
    None where they are the token count and it is dynamic. Nothing is timed here (see :func:`measure`).
    """
    if requested == "dense":
        return Decision("dense", "train_kernel='dense' was requested")
    if not_24 is not None:
        return Decision("dense", not_24)
    kernel = "cusparselt" if requested == "auto" else requested
    if kernel != "reference":
        why = kernel_unavailable(
            kernel, device_type, dtype, cusparselt_available=cusparselt_available, capability=capability
        )
        if why is not None:
            if requested == "auto":
                return Decision("dense", why)
            raise TrainKernelError(
                f"nmsparse option train_kernel={requested!r} cannot run the {role} GEMM of {layer!r}: {why}. "
                "Use train_kernel='auto' (sparse only where it can run and is faster) or 'reference' (any device)"
            )
    dims = (rows, cols if cols is not None else ALIGNMENT[kernel][1], n if n is not None else ALIGNMENT[kernel][2])
    bad = misaligned(kernel, *dims)
    if bad is not None:
        return Decision("dense", bad)
    dynamic = cols is None or n is None
    if dynamic and requested == "auto":
        return Decision("dense", "the token count is dynamic; auto times static shapes only (force a kernel to use it)")
    reason = {
        "reference": "2:4 operand packed in CUTLASS's layout, dense product (checks the rewrite on any device)",
        "cusparselt": "2:4 operand, fp16/bf16, shapes qualify",
        "cutlass": "2:4 operand, fp16/bf16, shapes qualify",
    }[kernel]
    if dynamic:
        reason += f"; calls whose token count does not fit {kernel}'s alignment take the dense GEMM"
    return Decision(kernel, reason)


def measure(
    decision: Decision, role: str, *, rows: int, cols: int, n: int, dtype, device, permuted: bool = False,
    graphs: bool = False,
) -> Decision:
    """Time the ``role`` GEMM as the training op runs it, sparse (compressing the operand at every
    call) against dense, on random operands of the layer's shapes; keep sparse only where faster.
    ``graphs``: GPU time under CUDA graphs (``mode="reduce-overhead"``), else each call's host work too.

    Only for cuSPARSELt/CUTLASS decisions on CUDA; others are returned unchanged.
    """
    if decision.kernel not in ("cusparselt", "cutlass"):
        return decision

    kernel = decision.kernel
    with torch.no_grad():
        a = _pruned(rows, cols, dtype, device)
        if role == "wgrad":  # dW = MVUE(dY)^T X: the gradient [tokens, out] transposed into the operand
            grad, x = a.t().contiguous(), torch.randn(cols, n, dtype=dtype, device=device)
            dense = lambda: grad.t() @ x  # noqa: E731
            sparse = lambda: sparse24_mm(grad.t().contiguous(), x, None, kernel, False, role)  # noqa: E731
        elif role == "dgrad":  # dX = dY @ W_d: the operand is W_d^T, W_d stored [out, in]
            w_d, grad = a.t().contiguous(), torch.randn(n, cols, dtype=dtype, device=device)
            perm = torch.randperm(cols, device=device)
            if permuted:  # Bi-Mask: W_d is 2:4 along out in the order perm (gathered back by the op)
                w_d = w_d.index_select(0, torch.argsort(perm))
            dense = lambda: grad @ w_d  # noqa: E731

            def sparse():
                g, w = (grad.index_select(1, perm), w_d.index_select(0, perm)) if permuted else (grad, w_d)
                return sparse24_mm(w.t().contiguous(), g.t(), None, kernel, True, role)
        else:  # forward x @ W^T, W [out, in]
            x = torch.randn(n, cols, dtype=dtype, device=device)
            dense = lambda: torch.nn.functional.linear(x, a)  # noqa: E731
            sparse = lambda: sparse24_mm(a, x.t(), None, kernel, True, role)  # noqa: E731
        dense_ms, sparse_ms = time_cuda(dense, graphs=graphs), time_cuda(sparse, graphs=graphs)
    speedup = dense_ms / sparse_ms
    if dense_ms > MARGIN * sparse_ms:
        return Decision(kernel, decision.reason, speedup=speedup)
    return Decision("dense", f"{kernel} (compressing each call) measured {speedup:.2f}x of dense", speedup=speedup)


def _pruned(rows: int, cols: int, dtype, device) -> torch.Tensor:
    return masks.prune(torch.randn(rows, cols, device=device), 2, 4, 1).to(dtype)
