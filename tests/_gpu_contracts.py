"""A CPU stand-in for the contracts of PyTorch's CUDA 2:4 ops, for tests only.

:func:`emulated_gpu` patches, for the duration of a ``with`` block, ``torch._cslt_compress``,
``torch._cslt_sparse_mm``, ``torch._cslt_sparse_mm_search``, ``torch._sparse_semi_structured_mm``
and ``torch._sparse_semi_structured_addmm`` with functions that accept and refuse what the CUDA ops
do, read their operands' memory the way the CUDA ops do, and compute the product on the CPU. It
also makes nmcompile's device rules treat the CPU as an emulated GPU of a given compute capability
and replaces the CUDA-event timer with one that calls the timed function once (so every timed shape
goes through the contracts) and reports the sparse kernel faster from ``faster_from`` tokens on.

What each emulated op models (PyTorch 2.13, the sources named):

``_cslt_compress(input)`` (aten/src/ATen/native/sparse/cuda/cuSPARSELtOps.cpp):
  - compute capability 8.0 or newer (cuSPARSELt's own requirement: sparse tensor cores);
  - dtype: int8, fp16, bf16, fp32, else "Unsupported dtype for cuSPARSELt compressed matrix";
  - ``cusparseLtStructuredDescriptorInit(rows=size(0), cols=size(1), ld=size(1), ORDER_ROW)``: the
    memory at ``data_ptr()`` is read as row-major with ``ld = cols`` whatever the strides; rows and
    cols must be the structured multiples of PyTorch's ``_DTYPE_SHAPE_CONSTRAINTS``
    (torch/sparse/semi_structured.py, ``SparseSemiStructuredTensorCUSPARSELT``: fp16/bf16 16 and 16);
  - ``cusparseLtSpMMACompress2`` compresses whatever it is given: a group of 4 with more than two
    non-zeros is not refused (here: its first two are kept, silently);
  - returns a 1-D tensor of ``numel * 9 // 16`` elements of the input's dtype (values, then metadata).

``_cslt_sparse_mm(compressed_A, dense_B, bias, alpha, out_dtype, transpose_result, alg_id, ...)``
(same file, ``_cslt_sparse_mm_impl``):
  - the input type comes from ``compressed_A``'s dtype, the output dtype from ``dense_B``'s; nothing
    checks that ``dense_B`` or ``bias`` have ``compressed_A``'s dtype: their memory is read as that type;
  - ``k = dense_B.size(0)``, ``n = dense_B.size(1)``, ``m = numel(compressed_A) * 16 / 9 / k``;
  - the layout is read from ``dense_B.is_contiguous()`` only: contiguous is row-major ``[k, n]``
    with ``ld = n``; anything else is taken as column-major with ``ld = k``
    (``CUSPARSE_OPERATION_TRANSPOSE``), and the real strides are never looked at;
  - ``cusparseLtDenseDescriptorInit`` for B and for the result: their rows and cols must be the dense
    multiples of ``_DTYPE_SHAPE_CONSTRAINTS`` (fp16/bf16: 8; PyTorch pads to them in
    ``SparseSemiStructuredTensorCUSPARSELT._mm``/``cusparselt_mm`` because cuSPARSELt refuses others);
  - ``bias`` is a raw pointer: ``m`` elements read at ``data_ptr()`` as the output type;
  - the result is ``[n, m]`` row-major (``(A @ B)^T``) with ``transpose_result``, else ``[m, n]``.

``_cslt_sparse_mm_search``: the same checks; returns an algorithm id (recorded with its shape).

``_sparse_semi_structured_mm(mat1, mat1_meta, mat2)`` / ``_addmm(input, mat1, mat1_meta, mat2)``
(aten/src/ATen/native/sparse/cuda/SparseSemiStructuredOps.cu, ``sparse_semi_structured_mad_op``):
  - compute capability 8.x only ("Supported only on GPUs with compute capability 8.x");
  - ``mat1.dtype == mat2.dtype``; ``input`` (the bias) 1-D, of the output dtype, ``mat1.size(0)`` long;
  - mat1 and mat2 2-D, each row- or column-major (a stride of 1), read through those strides;
  - ``mat1.size(1) == mat2.size(0) / 2``; metadata int16 for 16-bit values, in CUTLASS's interleaved
    order; rows by 32, the reduction dim by 64, the other dim by 8 (PyTorch's
    ``SparseSemiStructuredTensorCUTLASS`` minimums and CUTLASS's 128-bit operand alignment, which
    ``can_implement`` refuses otherwise);
  - the result is ``[m, n]`` row-major of the output dtype.

Every call is recorded in :attr:`Emulator.calls` (op name, the dims it used, the layout it read,
dtypes), so that tests can assert that a sparse kernel really ran and with what.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from unittest import mock

import torch

import nmcompile
from nmcompile.kernels import dispatch
from nmcompile.kernels.dispatch import train as train_dispatch
from nmcompile.kernels.format24 import row_meta

# the pass's module (nmcompile.passes exports a function of the same name)
find_deployed_weights = importlib.import_module("nmcompile.passes.find_deployed_weights")

#: torch/sparse/semi_structured.py, SparseSemiStructuredTensorCUSPARSELT._DTYPE_SHAPE_CONSTRAINTS:
#: (sparse min rows, sparse min cols, dense min rows, dense min cols)
CUSPARSELT_SHAPES = {
    torch.int8: (32, 32, 16, 16),
    torch.float16: (16, 16, 8, 8),
    torch.bfloat16: (16, 16, 8, 8),
    torch.float32: (8, 8, 4, 4),
}
#: cuSPARSELtOps.cpp: compression_factor 9 (10 for int8): the compressed buffer holds numel * 9 / 16 elements
COMPRESSION = 9
#: CUTLASS (SparseSemiStructuredOps.cu and SparseSemiStructuredTensorCUTLASS): rows, reduction dim, other dim
CUTLASS_MULTIPLES = (32, 64, 8)


class ContractError(RuntimeError):
    """What the CUDA op would raise (the same condition, worded as the emulator's)."""


@dataclass
class Call:
    op: str
    dims: tuple
    layout: str = ""
    dtypes: tuple = ()
    alg_id: int | None = None


def _read(t: torch.Tensor, dtype: torch.dtype, size, stride) -> torch.Tensor:
    """The memory from ``t.data_ptr()`` read as ``dtype`` with ``size``/``stride`` (in ``dtype``'s
    elements): what a kernel handed a raw pointer does. Out of the storage's bounds is an error."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=dtype).set_(storage)
    offset_bytes = t.storage_offset() * t.element_size()
    itemsize = flat.element_size()
    if offset_bytes % itemsize:
        raise ContractError(f"a {t.dtype} operand read as {dtype} starts inside an element")
    try:
        return flat.as_strided(size, stride, offset_bytes // itemsize)
    except RuntimeError as exc:
        raise ContractError(f"the kernel reads past the operand's memory ({size}, {stride}): {exc}") from exc


def _expand(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The dense ``[m, k]`` operand from 2:4 values ``[m, k/2]`` and row-order int16 metadata
    ``[m, k/16]`` (a 2-bit position per kept value, four groups per word), as the tensor cores read
    it: no validation, and nothing read back to the host."""
    words = meta.to(torch.int32) & 0xFFFF
    shifts = torch.arange(4, dtype=torch.int32) * 4
    nibbles = ((words[..., None] >> shifts) & 0xF).flatten(-2)  # [m, k/4]
    positions = torch.stack([nibbles & 3, nibbles >> 2], -1).long()  # [m, k/4, 2]
    dense = torch.zeros((*positions.shape[:-1], 4), dtype=values.dtype)
    dense.scatter_(-1, positions, values.unflatten(-1, (-1, 2)))
    return dense.flatten(-2)


def _dense_multiple(what: str, size: int, multiple: int, dtype) -> None:
    if size % multiple or size == 0:
        raise ContractError(
            f"cuSPARSELt: {what} = {size} is not a multiple of {multiple} for {dtype} "
            "(CUSPARSE_STATUS_INVALID_VALUE; PyTorch's own 2:4 tensors pad to it)"
        )


@dataclass
class Emulator:
    capability: tuple[int, int] = (9, 0)
    faster_from: int = 0  # the fake timer: the sparse kernel is faster from this many tokens on
    calls: list[Call] = field(default_factory=list)
    graph_timings: list[bool] = field(default_factory=list)  # the timer's graphs= argument, per call

    def names(self) -> list[str]:
        return [c.op for c in self.calls]

    # ---- cuSPARSELt

    def _cslt_arch(self) -> None:
        if tuple(self.capability) < (8, 0):  # cusparseLtInit on a GPU without sparse tensor cores
            raise ContractError(f"cuSPARSELt: CUSPARSE_STATUS_ARCH_MISMATCH on sm{self.capability[0]}{self.capability[1]}")

    def cslt_compress(self, sparse_input: torch.Tensor) -> torch.Tensor:
        self._cslt_arch()
        dtype = sparse_input.dtype
        if dtype not in CUSPARSELT_SHAPES:
            raise ContractError("Unsupported dtype for cuSPARSELt compressed matrix")
        if dtype == torch.int8:
            raise ContractError("emulator: int8 compression (factor 10) is not modelled; nmcompile never uses it")
        if sparse_input.dim() != 2:
            raise ContractError(f"_cslt_compress takes a 2-D matrix, got {tuple(sparse_input.shape)}")
        rows, cols = sparse_input.shape
        min_rows, min_cols = CUSPARSELT_SHAPES[dtype][:2]
        for what, size, multiple in (("rows", rows, min_rows), ("cols", cols, min_cols)):
            if size % multiple or size == 0:
                raise ContractError(f"cuSPARSELt: structured {what} = {size} is not a multiple of {multiple} for {dtype}")
        dense = _read(sparse_input, dtype, (rows, cols), (cols, 1))  # ld = cols, whatever the strides
        packed = nmcompile.pack(dense.contiguous(), check=False)  # compresses whatever it is given
        out = torch.zeros(rows * cols * COMPRESSION // 16, dtype=dtype)
        half = rows * cols // 2
        out[:half] = packed.values.reshape(-1)
        out[half:].view(torch.int16)[: packed.meta.numel()] = packed.meta.reshape(-1)
        self.calls.append(Call("cslt_compress", (rows, cols), "row", (dtype,)))
        return out

    def _cslt_operands(self, compressed_A, dense_B, bias, out_dtype, transpose_result):
        self._cslt_arch()
        dtype = compressed_A.dtype
        if dtype not in CUSPARSELT_SHAPES or dtype == torch.int8:
            raise ContractError("Unsupported dtype for cuSPARSELt compressed matrix multiplication.")
        if out_dtype is not None:
            raise ContractError("out_dtype support only available for int8 inputs")
        k, n = dense_B.shape
        m = compressed_A.numel() * 16 // COMPRESSION // k
        min_rows, min_cols, dense_rows, dense_cols = CUSPARSELT_SHAPES[dtype]
        if m % min_rows or k % min_cols or m == 0:
            raise ContractError(f"cuSPARSELt: structured [m, k] = [{m}, {k}] is not a multiple of [{min_rows}, {min_cols}]")
        row_major = dense_B.is_contiguous()
        if row_major:  # descriptor (k, n, ld n)
            _dense_multiple("dense rows (k)", k, dense_rows, dtype)
            _dense_multiple("dense cols/ld (n)", n, dense_cols, dtype)
            b = _read(dense_B, dtype, (k, n), (n, 1))
        else:  # descriptor (n, k, ld k), CUSPARSE_OPERATION_TRANSPOSE: B^T row-major, the strides unread
            _dense_multiple("dense rows (n)", n, dense_rows, dtype)
            _dense_multiple("dense cols/ld (k)", k, dense_cols, dtype)
            b = _read(dense_B, dtype, (k, n), (1, k))
        _dense_multiple("result rows (m)", m, dense_rows, dtype)
        _dense_multiple("result cols (n)", n, dense_cols, dtype)
        half = m * k // 2
        values = compressed_A[:half].view(m, k // 2)
        meta = compressed_A[half:].view(torch.int16)[: m * k // 16].view(m, k // 16)
        a = _expand(values, meta)
        out_type = dense_B.dtype  # the result's dtype is B's; it is written as the input type's bits
        product = a.float() @ b.float()
        if bias is not None:
            product = product + _read(bias, out_type, (m,), (1,)).float()[:, None]
        result = product.to(out_type)
        call = Call("cslt_sparse_mm", (m, k, n), "row" if row_major else "col", (dtype, dense_B.dtype))
        return (result.t().contiguous() if transpose_result else result.contiguous()), call

    def cslt_sparse_mm(self, compressed_A, dense_B, bias=None, alpha=None, out_dtype=None, transpose_result=False,
                       alg_id=0, split_k=1, split_k_mode=-1):
        if alpha is not None:
            raise ContractError("emulator: alpha scaling is not modelled; nmcompile never passes it")
        out, call = self._cslt_operands(compressed_A, dense_B, bias, out_dtype, transpose_result)
        call.alg_id = int(alg_id)
        self.calls.append(call)
        return out

    def cslt_sparse_mm_search(self, compressed_A, dense_B, bias=None, alpha=None, out_dtype=None,
                              transpose_result=False):
        _, call = self._cslt_operands(compressed_A, dense_B, bias, out_dtype, transpose_result)
        call.op, call.alg_id = "cslt_sparse_mm_search", 0
        self.calls.append(call)
        return 0

    # ---- CUTLASS

    def _cutlass(self, bias, mat1, mat1_meta, mat2, alpha, beta, out_dtype):
        name = "sparse_semi_structured_addmm" if bias is not None else "sparse_semi_structured_mm"
        if self.capability[0] != 8:
            raise ContractError(f"{name} : Supported only on GPUs with compute capability 8.x")
        out_dtype = out_dtype or mat2.dtype
        if mat1.dtype != mat2.dtype:
            raise ContractError(f"{name} : Expected mat1 datatype {mat2.dtype}, but got {mat1.dtype}")
        if bias is not None and (bias.dtype != out_dtype or bias.dim() != 1 or bias.shape[0] != mat1.shape[0]):
            raise ContractError(f"{name} : the input (bias) must be 1-D, {out_dtype}, {mat1.shape[0]} long")
        for what, t in (("mat1", mat1), ("mat2", mat2)):
            if t.dim() != 2:
                raise ContractError(f"{name} : Expected {what} argument to be 2D tensor, got {t.dim()} dims")
            if 1 not in t.stride():
                raise ContractError(f"{name} : Invalid strides for {what} argument: {t.stride()}")
        m, k, n = mat1.shape[0], mat2.shape[0], mat2.shape[1]
        if mat1.shape[1] != k // 2:
            raise ContractError(f"{name} : Expected mat1 argument to have {k // 2} columns, but got {mat1.shape[1]}")
        if mat1_meta.dtype != torch.int16 or tuple(mat1_meta.shape) != (m, k // 16):
            raise ContractError(f"{name} : Expected int16 metadata [{m}, {k // 16}], got {mat1_meta.dtype} {tuple(mat1_meta.shape)}")
        for size, multiple, what in zip((m, k, n), CUTLASS_MULTIPLES, ("rows", "reduction dim", "other dim")):
            if size % multiple or size == 0:
                raise ContractError(f"{name} : CUTLASS cannot implement the problem: {what} {size} is not a multiple of {multiple}")
        a = _expand(mat1, row_meta(mat1_meta.contiguous()))
        product = float(alpha) * (a.float() @ mat2.float())
        if bias is not None:
            product = product + float(beta) * bias.float()[:, None]
        layout = "row" if mat2.stride(1) == 1 else "col"
        self.calls.append(Call(name, (m, k, n), layout, (mat1.dtype, mat2.dtype)))
        return product.to(out_dtype).contiguous()

    def semi_structured_mm(self, mat1, mat1_meta, mat2, *, out_dtype=None):
        return self._cutlass(None, mat1, mat1_meta, mat2, 1, 1, out_dtype)

    def semi_structured_addmm(self, input, mat1, mat1_meta, mat2, *, alpha=1, beta=1, out_dtype=None):
        return self._cutlass(input, mat1, mat1_meta, mat2, alpha, beta, out_dtype)

    # ---- nmcompile's device rules and timer, with the CPU as the GPU

    def time(self, fn, reps: int = 20, graphs: bool = False) -> float:
        self.graph_timings.append(graphs)  # whether the compile asked for GPU time under CUDA graphs
        before = len(self.calls)
        fn()
        sparse = [c for c in self.calls[before:] if c.op in ("cslt_sparse_mm", "sparse_semi_structured_mm",
                                                             "sparse_semi_structured_addmm")]
        if not sparse:
            return 2.0  # the dense GEMM
        tokens = sparse[-1].dims[2]
        return 1.0 if tokens >= self.faster_from else 3.0


@contextlib.contextmanager
def emulated_gpu(capability: tuple[int, int] = (9, 0), faster_from: int = 0):
    """Within the block, the CUDA 2:4 ops are the :class:`Emulator`'s and nmcompile takes the CPU for
    a GPU of ``capability`` with cuSPARSELt; everything patched is restored on exit."""
    emulator = Emulator(capability=capability, faster_from=faster_from)
    real_unavailable, real_qualify = dispatch.kernel_unavailable, dispatch.qualify

    def unavailable(kernel, device_type, dtype, **kw):
        return real_unavailable(kernel, "cuda" if device_type == "cpu" else device_type, dtype, **kw)

    def qualify(weight, requested, **kw):
        return real_qualify(weight, requested, **{"device_type": "cuda", **kw})

    patches = [
        mock.patch.object(torch, "_cslt_compress", emulator.cslt_compress),
        mock.patch.object(torch, "_cslt_sparse_mm", emulator.cslt_sparse_mm),
        mock.patch.object(torch, "_cslt_sparse_mm_search", emulator.cslt_sparse_mm_search),
        mock.patch.object(torch, "_sparse_semi_structured_mm", emulator.semi_structured_mm),
        mock.patch.object(torch, "_sparse_semi_structured_addmm", emulator.semi_structured_addmm),
        mock.patch.object(torch.backends.cusparselt, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: capability),
        mock.patch.object(dispatch, "kernel_unavailable", unavailable),
        mock.patch.object(train_dispatch, "kernel_unavailable", unavailable),
        mock.patch.object(find_deployed_weights, "qualify", qualify),
        mock.patch.object(dispatch, "time_cuda", emulator.time),
        mock.patch.object(train_dispatch, "time_cuda", emulator.time),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield emulator

