"""The dtype one-shot calibration computes in, apart from the dtype the model is stored in.

A bf16 checkpoint stays bf16 through ``nmcompile prune`` (its bytes, what is written), but a CPU
without native bf16 arithmetic (no ``avx512_bf16`` or ``amx_bf16``: AVX2 machines) multiplies bf16
matrices several times slower than float32: on a 2-core AVX2 EPYC a [512, 2048] x [2048, 8192] bf16
``linear`` took 7.7 s against 1.3 s in float32, and the held-out loss of a Llama-3.2-1B-shaped model
on 1 024 tokens took 340 s in bf16. There, the calibration forwards compute in float32 one piece at a
time: a block of a sequential solve, or each module of an eager forward, is raised to float32 while
it runs and written back into its own bf16 storage after (rounding what a solve wrote in float32 as
the solve itself would). Only one piece is held in float32 at a time, so memory stays near the
stored model's bytes.

:func:`compute_dtype` says which dtype applies (and why); :func:`raised` raises a module for the
length of a ``with`` block; :func:`raised_per_module` does it for each module of an eager forward as
it runs (forward hooks; not for compiled graphs).
"""

from __future__ import annotations

import contextlib
from functools import lru_cache

import torch
from torch import nn

from ..state import memory

__all__ = ["compute_dtype", "raised", "raised_per_module", "stored_dtype", "to_dtype"]

#: CPU flags that make each low-precision matmul native (Linux ``/proc/cpuinfo``)
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def stored_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s floating-point parameters (the first one's; float32 if none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def compute_dtype(model: nn.Module, asked: torch.dtype | None = None) -> tuple[torch.dtype, str]:
    """``(dtype, why)``: ``asked`` if given, else float32 for a bf16/fp16 model on a CPU without
    native arithmetic for it (see :data:`NATIVE_FLAGS`), else the model's own dtype."""
    stored = stored_dtype(model)
    name = str(stored).replace("torch.", "")
    if asked is not None:
        return asked, f"computed in {str(asked).replace('torch.', '')}, as asked"
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if stored in NATIVE_FLAGS and device.type == "cpu":
        if not _cpu_flags() & set(NATIVE_FLAGS[stored]):
            return torch.float32, (f"computed in float32 one block at a time, kept in {name}: this CPU has no native "
                                   f"{name} arithmetic ({' or '.join(NATIVE_FLAGS[stored])})")
    return stored, f"computed in {name}"


def _raise(module: nn.Module, dtype: torch.dtype, recurse: bool) -> list:
    """Move ``module``'s low-precision parameters to ``dtype``; what :func:`_lower` needs to undo it."""
    moved = []
    for p in module.parameters(recurse=recurse):
        if p.is_floating_point() and p.dtype != dtype and p.dtype in NATIVE_FLAGS and not p.is_meta:
            stored = p.data
            p.data = p.data.to(dtype)
            moved.append((p, stored, p._version))
    return moved


def _lower(moved: list, written_only: bool = False) -> None:
    """Write each raised parameter back into its own storage (a mapped checkpoint's pages are written
    in place, so no second copy of the weight becomes resident) and give it that storage again.
    ``written_only``: skip a parameter whose version counter says it was not written through itself
    (a forward that only reads it)."""
    with torch.no_grad():
        for p, stored, version in moved:
            if not written_only or p._version != version:
                stored.copy_(p.data)
            p.data = stored


@contextlib.contextmanager
def raised(module: nn.Module, dtype: torch.dtype):
    """``module``'s bf16/fp16 parameters in ``dtype`` for the ``with`` block, written back after (even on
    an error). A no-op where they already are ``dtype``."""
    moved = _raise(module, dtype, recurse=True)
    try:
        yield module
    finally:
        _lower(moved)


def to_dtype(value, dtype: torch.dtype):
    """``value`` (a tensor, or tuples, lists and dicts of them) with its bf16/fp16 tensors in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype in NATIVE_FLAGS else value
    if isinstance(value, (tuple, list)):
        return type(value)(to_dtype(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: to_dtype(v, dtype) for k, v in value.items()}
    return value


#: a ``Linear`` whose weight raised whole would take more than this many bytes runs in output-row
#: chunks of at most this size instead (a tied 128k-word output head is 1.05 GB in float32 at width 2048)
CHUNK_BYTES = 1 << 27


def _in_chunks(module: nn.Module, dtype: torch.dtype) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and weight is not None and weight.dtype in NATIVE_FLAGS
            and weight.numel() * dtype.itemsize > CHUNK_BYTES)


def linear_in_chunks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in ``dtype`` with at most :data:`CHUNK_BYTES` of ``weight``
    raised at a time (output rows in chunks)."""
    x = x.to(dtype)
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=dtype, device=x.device)
    rows = max(1, CHUNK_BYTES // (weight.shape[1] * out.element_size()))
    for r in range(0, weight.shape[0], rows):
        part = None if bias is None else bias[r:r + rows].to(dtype)
        out[..., r:r + rows] = torch.nn.functional.linear(x, weight[r:r + rows].to(dtype), part)
    return out


@contextlib.contextmanager
def raised_per_module(model: nn.Module, dtype: torch.dtype):
    """For an eager forward of ``model``: each module that holds parameters (but embeddings, which
    only gather rows) runs with them and its floating inputs in ``dtype``; one module's parameters are
    raised at a time, and dropped when it returns (a forward only reads them; one written through the
    parameter is written back). A plain ``nn.Linear`` too large to raise whole (:data:`CHUNK_BYTES`,
    e.g. a large vocabulary's output head) is computed in chunks of output rows: its own forward is
    handed an empty batch and its output replaced by :func:`linear_in_chunks`' (its weight is only
    read). A no-op where the model is already ``dtype``."""
    if stored_dtype(model) == dtype:
        yield model
        return
    pending: dict[int, list] = {}
    inputs: dict[int, list] = {}
    handles = []

    def pre(module, args, kwargs):
        pending[id(module)] = pending.get(id(module), []) + [_raise(module, dtype, recurse=False)]
        return to_dtype(args, dtype), to_dtype(kwargs, dtype)

    def post(module, args, kwargs, output):  # a forward reads its weights: nothing to write back
        _lower(pending[id(module)].pop(), written_only=True)

    def pre_chunked(module, args, kwargs):
        x = args[0] if args else kwargs["input"]
        inputs.setdefault(id(module), []).append(x)
        empty = x.new_empty((0, x.shape[-1]), dtype=module.weight.dtype)
        return ((empty,), {}) if args else ((), {"input": empty})

    def post_chunked(module, args, kwargs, output):
        x = inputs[id(module)].pop()
        return linear_in_chunks(x, module.weight, module.bias, dtype)

    try:
        for module in model.modules():  # an embedding only gathers rows: it stays as it is
            if _in_chunks(module, dtype):
                handles.append(module.register_forward_pre_hook(pre_chunked, with_kwargs=True))
                handles.append(module.register_forward_hook(post_chunked, with_kwargs=True))
            elif any(True for _ in module.parameters(recurse=False)) and not isinstance(module, nn.Embedding):
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for stack in pending.values():  # a forward that failed part-way: nothing stays raised
            while stack:
                _lower(stack.pop(), written_only=True)
        memory.trim_heap()  # the raised copies were freed below malloc's mmap threshold: hand the pages back
