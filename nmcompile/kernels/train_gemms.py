"""2:4 sparse GEMMs in the training graph: the forward, input-gradient and weight-gradient products.

``nmsparse::sparse24_mm(a, b, bias, kernel, transpose_result, what)`` is ``a @ b`` (plus ``bias``
per row of ``a``; transposed when ``transpose_result``) for a 2:4 operand ``a`` ``[M, K]`` (groups
of 4 along ``K``, its reduction dim), compressed at every call, since training operands change
every step:

- ``cusparselt``: ``torch._cslt_compress(a)`` then ``torch._cslt_sparse_mm`` (bias and transpose
  fused);
- ``cutlass``: ``a`` packed by :func:`nmcompile.pack` into CUTLASS's layout
  (:meth:`~nmcompile.kernels.format24.Packed24.cutlass`: exact for any 2:4 operand, where
  ``torch._sparse_semi_structured_tile`` would re-prune it to a 4x4-tile pattern), then
  ``torch._sparse_semi_structured_mm``/``_addmm``;
- ``reference`` (any device): ``a`` packed into that same CUTLASS layout, densified again (by
  PyTorch's own reader ``sparse_semi_structured_to_dense_cutlass`` for fp16/bf16, through
  :func:`~nmcompile.kernels.format24.row_meta` and :func:`nmcompile.unpack` otherwise) and
  multiplied densely. It raises if ``a`` is not 2:4, so CPU runs check every claim the rewrite
  makes about its operands, and their layouts, orientations and gradients.

A call whose shape does not fit the kernel's :data:`ALIGNMENT` (possible only with dynamic shapes:
static ones are checked when compiling) takes the dense product instead.

``nmsparse::sparse_train_linear(x, w, w_dgrad, bias, scale, gate, perm, mvue_n, mvue_m, fp8,
forward, dgrad, wgrad, what)`` is ``nmsparse::linear`` (see :mod:`nmcompile.ops`) with a kernel per
GEMM (``"dense"`` or one of :data:`nmcompile.kernels.names.TRAIN_KERNELS`); with ``scale`` (S-STE's 0-d ``beta``) the effective
weight is ``scale * w`` and the GEMM outputs are scaled instead of the weight:

- forward ``x @ w^T``: the 2:4 operand is ``w`` ``[out, in]``; dense while the 0-d bool ``gate``
  (STEP's phase) is False;
- DGRAD ``dX = dY @ w_dgrad``: the operand is ``w_dgrad^T`` ``[in, out]``, 2:4 along ``out``
  (transposable masks), after ordering the output rows by ``perm`` (Bi-Mask:
  ``dX = dY[:, perm] @ w_dgrad[perm]``);
- WGRAD ``dW = MVUE(dY)^T X``: the operand is ``MVUE(dY)^T`` ``[out, tokens]``, 2:4 along the tokens.

Its gradient with respect to ``w`` is the gradient with respect to the effective weight, as
``nmsparse::linear`` gives it. FP8 (``fp8``) rounds the operands as ``nmsparse::linear`` does; the
rounded values keep their zeros, so the 2:4 kernels take them unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import masks
from ..ops import E4M3, E5M2, fake_fp8, mvue_along, register_autocast
from .names import TRAIN_KERNELS
from .format24 import CUTLASS_COLS, CUTLASS_ROWS, Packed24, cutlass_meta, pack, unpack

__all__ = ["sparse24_mm", "sparse_train_linear", "sparse_train_linear_gated", "ALIGNMENT", "misaligned", "strided"]

#: per kernel, the multiples each dim must be: (rows of the 2:4 operand, its reduction dim, the
#: dense operand's other dim). cuSPARSELt and CUTLASS: PyTorch's fp16/bf16 minimums
#: (``torch.sparse.SparseSemiStructuredTensor*._DTYPE_SHAPE_CONSTRAINTS``), which it pads to and we
#: require instead; reference: the CUTLASS metadata layout it packs into (rows by 32, the reduction dim
#: by 32: two 16-bit words of four groups, interleaved in pairs; see :data:`.packed.CUTLASS_COLS`)
ALIGNMENT = {"reference": (CUTLASS_ROWS, CUTLASS_COLS, 1), "cusparselt": (16, 16, 8), "cutlass": (32, 64, 8)}
_HALF = (torch.float16, torch.bfloat16)


def misaligned(kernel: str, rows: int, cols: int, n: int) -> str | None:
    """Why an ``[rows, cols]`` 2:4 operand times a ``[cols, n]`` one does not fit ``kernel``, or None."""
    need = ALIGNMENT[kernel]
    for size, multiple, what in zip((rows, cols, n), need, ("row count", "reduction dim", "other operand's dim")):
        if size % multiple or size == 0:
            return f"the 2:4 operand is [{rows}, {cols}] x [{cols}, {n}]: its {what} ({size}) is not a multiple of {multiple} ({kernel})"
    return None


def _densify(a: Tensor, what: str) -> Tensor:
    """``a`` through the CUTLASS layout and back: packed values + interleaved metadata, then dense."""
    bad, total = masks.count_violations(a, 2, 4, -1)
    if bad:
        raise ValueError(
            f"nmsparse::sparse24_mm: {what}: the operand given to the 2:4 kernel is not 2:4 along its reduction "
            f"dim ({bad}/{total} groups of 4 keep more than 2 non-zeros); nmcompile's training rewrite claimed it "
            "was: please report this with the recipe"
        )
    packed = pack(a.contiguous())
    values, meta = packed.values, cutlass_meta(packed.meta)
    if a.dtype in _HALF:
        from torch.sparse._semi_structured_conversions import sparse_semi_structured_to_dense_cutlass

        return sparse_semi_structured_to_dense_cutlass(values, meta)
    return unpack(Packed24.from_cutlass(values, meta))


def _dense_mm(a: Tensor, b: Tensor, bias: Optional[Tensor], transpose_result: bool) -> Tensor:
    if transpose_result:  # (a @ b)^T computed as b^T @ a^T: F.linear's own orientation for the forward
        return torch.addmm(bias, b.t(), a.t()) if bias is not None else b.t() @ a.t()
    return torch.addmm(bias[:, None], a, b) if bias is not None else a @ b


def strided(b: Tensor) -> Tensor:
    """``b`` row- or column-major, as the 2:4 kernels read it (cuSPARSELt takes any non-contiguous
    operand for column-major without reading its strides)."""
    return b if b.is_contiguous() or b.t().is_contiguous() else b.contiguous()


def _sparse24_mm(
    a: Tensor, b: Tensor, bias: Optional[Tensor], kernel: str, transpose_result: bool, what: str
) -> Tensor:
    rows, cols = a.shape
    if kernel not in TRAIN_KERNELS:
        raise ValueError(f"nmsparse::sparse24_mm: unknown kernel {kernel!r}; accepted: {', '.join(TRAIN_KERNELS)}")
    if misaligned(kernel, rows, cols, b.shape[1]) is not None:
        out = _dense_mm(a, b, bias, transpose_result)
    elif kernel == "reference":
        out = _dense_mm(_densify(a, what), b, bias, transpose_result)
    elif kernel == "cusparselt":
        out = torch._cslt_sparse_mm(
            torch._cslt_compress(a.contiguous()), strided(b), bias=bias, transpose_result=transpose_result
        )
        if transpose_result and out.shape[0] != b.shape[1]:  # builds without the fused transpose
            out = out.t()
    else:
        # unchecked: a checked pack reads a count back to the host (one sync per GEMM); the operand is 2:4
        # by the recipe's construction, which the reference kernel checks on any device
        values, meta = pack(a.contiguous(), check=False).cutlass()
        b = strided(b)
        if bias is None:
            out = torch._sparse_semi_structured_mm(values, meta, b)
        else:
            out = torch._sparse_semi_structured_addmm(bias, values, meta, b)
        out = out.t() if transpose_result else out
    return out.contiguous()


sparse24_mm = torch.library.custom_op("nmsparse::sparse24_mm", _sparse24_mm, mutates_args=())


@sparse24_mm.register_fake
def _(a, b, bias, kernel, transpose_result, what):
    shape = (b.shape[1], a.shape[0]) if transpose_result else (a.shape[0], b.shape[1])
    return b.new_empty(shape)


def _sparse_train_linear(
    x: Tensor, w: Tensor, w_dgrad: Tensor, bias: Optional[Tensor], scale: Optional[Tensor], gate: Optional[Tensor],
    perm: Optional[Tensor], mvue_n: int, mvue_m: int, fp8: bool, forward: str, dgrad: str, wgrad: str, what: str,
) -> Tensor:
    if fp8:
        x, w = fake_fp8(x, E4M3), fake_fp8(w, E4M3)
    fused_bias = bias if scale is None else None
    if forward == "dense" or (gate is not None and not bool(gate)):  # STEP's dense phase: one sync per call
        out = F.linear(x, w, fused_bias)
    else:
        x2 = x.reshape(-1, x.shape[-1])
        out = sparse24_mm(w, x2.t(), fused_bias, forward, True, f"{what} forward").reshape(*x.shape[:-1], w.shape[0])
    if scale is not None:
        out = out * scale.to(out.dtype)
        if bias is not None:
            out = out + bias
    return out


#: Inductor's tag for ops that must not be captured in a CUDA graph (torch >= 2.9)
_CUDAGRAPH_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)

sparse_train_linear = torch.library.custom_op("nmsparse::sparse_train_linear", _sparse_train_linear, mutates_args=())
#: the same op for a forward gated by a 0-d tensor (STEP's phase): reading the gate is a host sync, which a
#: CUDA graph cannot capture, so it carries Inductor's ``cudagraph_unsafe`` tag: under
#: ``mode="reduce-overhead"`` Inductor runs it outside the graphs (partitions around it, or skips graphs)
sparse_train_linear_gated = torch.library.custom_op(
    "nmsparse::sparse_train_linear_gated", _sparse_train_linear, mutates_args=(), tags=_CUDAGRAPH_UNSAFE
)


def _fake(x, w, w_dgrad, bias, scale, gate, perm, mvue_n, mvue_m, fp8, forward, dgrad, wgrad, what):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _setup(ctx, inputs, output):
    x, w, w_dgrad, bias, scale, gate, perm = inputs[:7]
    ctx.has_bias = bias is not None
    ctx.args = inputs[7:]
    ctx.save_for_backward(x, w_dgrad, scale, perm)


def _backward(ctx, grad):
    x, w_dgrad, scale, perm = ctx.saved_tensors
    mvue_n, mvue_m, fp8, _, dgrad, wgrad, what = ctx.args
    g = grad.reshape(-1, grad.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        gd, wd = (fake_fp8(g, E5M2), fake_fp8(w_dgrad, E5M2)) if fp8 else (g, w_dgrad)
        if dgrad == "dense":
            dx = gd @ wd
        else:  # dX^T = w_dgrad^T @ dY^T, the operand 2:4 along the (permuted) output rows
            if perm is not None:
                gd, wd = gd.index_select(1, perm), wd.index_select(0, perm)
            dx = sparse24_mm(wd.t().contiguous(), gd.t(), None, dgrad, True, f"{what} dgrad")
        if scale is not None:
            dx = dx * scale.to(dx.dtype)
        dx = dx.reshape(x.shape)
    if ctx.needs_input_grad[1]:
        gw = mvue_along(g, mvue_n, mvue_m, 0) if mvue_n else g
        if fp8:
            gw, x2 = fake_fp8(gw, E5M2), fake_fp8(x2, E5M2)
        if wgrad == "dense":
            dw = gw.t() @ x2
        else:  # the operand MVUE(dY)^T is 2:4 along the tokens
            dw = sparse24_mm(gw.t().contiguous(), x2, None, wgrad, False, f"{what} wgrad")
    if ctx.has_bias and ctx.needs_input_grad[3]:
        db = g.sum(0)
    return dx, dw, None, db, None, None, None, None, None, None, None, None, None, None


for _op in (sparse_train_linear, sparse_train_linear_gated):
    _op.register_fake(_fake)
    _op.register_autograd(_backward, setup_context=_setup)
    register_autocast(_op)  # as for nmsparse::linear
