"""The deploy side of the Inductor integration: the fused 2:4 linear op and the compile-cache key.

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

:class:`CacheKeyPass` is a no-op post-grad pass whose ``uuid()`` hashes nmcompile's version, the
files that define its ops and passes, and the compile's plan (recipes, kernel decisions), so
Inductor's FX graph cache and AOTAutograd's cache never serve a graph built by other code.
:class:`Decompositions` is the table the backend hands Inductor, which pickles as what builds it:
Inductor pickles the table into its FX graph cache key, and a plain dict of Inductor's own table
holds functions that do not pickle, so every graph compiled with it bypassed the cache (a second
process compiled every 2:4 model anew).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..ops import autocast_kernel
from .packed import Packed24, pack, unpack
from .training import ALIGNMENT, strided

__all__ = ["sparse_linear", "compress", "padded_tokens", "CacheKeyPass", "ChainedPass", "KERNELS", "DENSE_MULTIPLE"]

KERNELS = ("cusparselt", "cpu24", "reference")
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

_LIB = torch.library.Library("nmsparse", "FRAGMENT")  # autocast kernels, as for nmsparse::linear
for _device in ("cpu", "cuda"):  # values (argument 2) keeps its dtype: cuSPARSELt's buffer holds metadata bits too
    _LIB.impl(
        sparse_linear._name, autocast_kernel(sparse_linear, _device, keep=(2,)),
        "Autocast" + torch._C._dispatch_key_for_device(_device), with_keyset=True,
    )


def compress(weight: Tensor, kernel: str) -> tuple[Tensor, Tensor]:
    """``(values, meta)`` of a 2:4 weight for ``kernel``: cuSPARSELt's one buffer, the CPU kernel's
    layout (:func:`nmcompile.kernels.cpu24.cpu_layout`: values and position bits), or the packed format."""
    with torch.no_grad():
        w = weight.detach().contiguous()
        if kernel == "cusparselt":
            from .. import masks

            bad, total = masks.count_violations(w, 2, 4, 1)
            if bad:
                raise ValueError(f"cannot compress a {tuple(w.shape)} weight for cuSPARSELt: {bad}/{total} groups are not 2:4")
            return torch._cslt_compress(w), w.new_empty(0, dtype=torch.int16)
        if kernel in ("reference", "cpu24"):
            packed = pack(w)
            if kernel == "cpu24":
                from . import cpu24

                return cpu24.cpu_layout(packed.values, packed.meta)
            return packed.values, packed.meta
    raise ValueError(f"unknown 2:4 kernel {kernel!r}; accepted: {', '.join(KERNELS)}")


@functools.lru_cache(maxsize=1)
def _code_hash() -> str:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class Decompositions(dict):
    """Inductor's decompositions, nmcompile's op bodies (:data:`nmcompile.ops.DECOMPOSITIONS`) and,
    where ``shared`` says, the shared projection kernels (:mod:`nmcompile.kernels.shared`): ``None``
    none, ``"all"`` every projection, or a tuple of the signatures (without strides) that share.

    It pickles as ``Decompositions(shared)``, so Inductor's cache key holds ``shared`` (its
    functions are torch's and nmcompile's code, which the key holds already: torch's version and
    :class:`CacheKeyPass`), and unpickling builds the same table."""

    def __init__(self, shared: str | tuple | None = None):
        from torch._inductor.compile_fx import select_decomp_table

        from .. import ops

        if not (shared is None or shared == "all" or isinstance(shared, tuple)):
            raise TypeError(f"Decompositions(shared): None, 'all' or a tuple of signatures, got {shared!r}")
        super().__init__({**select_decomp_table(), **ops.DECOMPOSITIONS})
        self.shared = shared
        if shared is not None:
            from .shared import decompositions

            self.update(decompositions((lambda sig: True) if shared == "all" else shared.__contains__))

    def __reduce_ex__(self, protocol):
        return Decompositions, (self.shared,)


class CacheKeyPass(CustomGraphPass):
    """No-op post-grad pass whose ``uuid`` makes the compile caches specific to nmcompile's code and plan."""

    def __init__(self, plan: str):
        self.plan = plan

    def __call__(self, graph) -> None:
        return None

    def uuid(self) -> str:
        from ..version import __version__

        return hashlib.sha256(f"nmcompile {__version__}\n{_code_hash()}\n{self.plan}".encode()).hexdigest()


class ChainedPass(CustomGraphPass):
    """Several post-grad passes run in order as one, for torch releases whose
    ``post_grad_custom_post_pass`` takes a single pass (2.11 calls it; a list is accepted from 2.13)."""

    def __init__(self, passes):
        self.passes = tuple(passes)

    def __call__(self, graph) -> None:
        for run in self.passes:
            run(graph)

    def uuid(self) -> str:
        parts = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        if any(part is None for part in parts):  # a plain function has no key: Inductor must not cache
            return None
        return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()


def with_cache_key(patches: dict, plan: str) -> dict:
    """``patches`` with :class:`CacheKeyPass` run after any ``post_grad_custom_post_pass`` the user set
    (one :class:`ChainedPass`, which every supported torch release takes)."""
    key = "post_grad_custom_post_pass"
    current = patches.get(key, torch._inductor.config.post_grad_custom_post_pass)
    ours = CacheKeyPass(plan)
    if current is None:
        combined = ours
    elif isinstance(current, (list, tuple)):
        combined = ChainedPass([*current, ours])
    else:
        combined = ChainedPass([current, ours])
    return {**patches, key: combined}
