"""The deploy op: the fused 2:4 linear that the deploy pass puts in the graph, for cuSPARSELt, the CPU kernel or any device.

``nmsparse::sparse_linear(x, weight, values, meta, bias, kernel, alg_id, min_tokens)`` computes
``F.linear(x, weight, bias)`` for a 2:4 ``weight`` ``[out, in]``:

- ``kernel="cusparselt"``: ``values`` is ``torch._cslt_compress(weight)`` (made once, when the
  graph is compiled), the product is ``torch._cslt_sparse_mm`` with the bias fused and the
  searched ``alg_id``; calls with fewer than ``min_tokens`` rows take the dense GEMM instead
  (decode shapes, where the sparse kernel measured slower). cuSPARSELt takes token counts that
  are multiples of :data:`DENSE_MULTIPLE` only: others are padded with zero rows and the result
  narrowed (as PyTorch's own 2:4 tensors do), and an input that is neither row- nor column-major
  is copied first (the op trusts ``is_contiguous()`` alone for the layout);
- ``kernel="reference"``: ``values``/``meta`` are :func:`nmcompile.pack`'s format and the product
  is a dense GEMM of the unpacked weight: the same graph, runnable and checkable on any device.

Inductor keeps the op as an extern kernel (the cuSPARSELt call has no Inductor template). Its
autograd is the dense one, so an eval-mode model with gradients enabled still differentiates.
Under ``torch.autocast`` it casts ``x``, ``weight`` and ``bias`` as ``F.linear`` would; a
compressed weight of another dtype than the autocast one takes the dense GEMM on ``weight``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import masks
from ..ops import register_autocast
from . import cpu24
from .names import DEPLOY_KERNELS
from .format24 import Packed24, pack, unpack
from .train_gemms import ALIGNMENT, strided

__all__ = ["sparse_linear", "compress", "padded_tokens", "DENSE_MULTIPLE"]

#: cuSPARSELt's dense dims (the token count here) must be multiples of 8 for fp16/bf16
DENSE_MULTIPLE = ALIGNMENT["cusparselt"][2]


def padded_tokens(tokens: int) -> int:
    """``tokens`` rounded up to the dense multiple cuSPARSELt takes (fp16/bf16: 8), as the kernel runs it."""
    return -(-tokens // DENSE_MULTIPLE) * DENSE_MULTIPLE


def _sparse_linear(
    x: Tensor, weight: Tensor, values: Tensor, meta: Tensor, bias: Optional[Tensor], kernel: str, alg_id: int,
    min_tokens: int,
) -> Tensor:
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if tokens == 0 or tokens < min_tokens:
        return F.linear(x, weight, bias)
    if kernel == "reference":
        return F.linear(x, unpack(Packed24(values, meta)).to(x.dtype), bias)
    if x.dtype != values.dtype:  # autocast to the other 16-bit type: the compressed buffer cannot be cast
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if tokens % DENSE_MULTIPLE:  # cuSPARSELt refuses other dense dims: pad the rows (a contiguous copy)
        x2 = F.pad(x2, (0, 0, 0, padded_tokens(tokens) - tokens))
    # _cslt_sparse_mm reads a non-contiguous dense operand as column-major with ld = in_features without
    # looking at its strides: a slice (h[..., :d]) or a strided view must be copied, or the result is wrong
    out = torch._cslt_sparse_mm(values, strided(x2.t()), bias=bias, transpose_result=True, alg_id=alg_id)
    if out.shape[0] != x2.shape[0]:  # builds without the fused transpose
        out = out.t()
    return out[:tokens].reshape(*x.shape[:-1], weight.shape[0]).contiguous()


sparse_linear = torch.library.custom_op("nmsparse::sparse_linear", _sparse_linear, mutates_args=())


@sparse_linear.register_fake
def _(x, weight, values, meta, bias, kernel, alg_id, min_tokens):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup(ctx, inputs, output):
    x, weight = inputs[:2]
    ctx.has_bias = inputs[4] is not None
    ctx.save_for_backward(x, weight)


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx = grad @ weight if ctx.needs_input_grad[0] else None
    dw = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
    return dx, dw, None, None, db, None, None, None


sparse_linear.register_autograd(_backward, setup_context=_setup)

# autocast kernels, as for nmsparse::linear; values (argument 2) keeps its dtype: cuSPARSELt's buffer holds
# metadata bits too
register_autocast(sparse_linear, keep=(2,))


def compress(weight: Tensor, kernel: str) -> tuple[Tensor, Tensor]:
    """``(values, meta)`` of a 2:4 weight for ``kernel``: cuSPARSELt's one buffer, the CPU kernel's
    layout (:func:`nmcompile.kernels.cpu24.cpu_layout`: values and position bits), or the packed format."""
    with torch.no_grad():
        w = weight.detach().contiguous()
        if kernel == "cusparselt":
            bad, total = masks.count_violations(w, 2, 4, 1)
            if bad:
                raise ValueError(f"cannot compress a {tuple(w.shape)} weight for cuSPARSELt: {bad}/{total} groups are not 2:4")
            return torch._cslt_compress(w), w.new_empty(0, dtype=torch.int16)
        if kernel in ("reference", "cpu24"):
            packed = pack(w)
            if kernel == "cpu24":
                return cpu24.cpu_layout(packed.values, packed.meta)
            return packed.values, packed.meta
    raise ValueError(f"unknown 2:4 kernel {kernel!r}; accepted: {', '.join(DEPLOY_KERNELS)}")
