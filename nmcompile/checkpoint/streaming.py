"""Weights read from a safetensors file a run of rows at a time, packed 2:4 on the way in.

:func:`read_packed` fills a :class:`~nmcompile.kernels.cpu24.weight.PackedLinearWeight` (the CPU kernel's
layout, made by :func:`nmcompile.kernels.cpu24.cpu_pack`) from chunks of the file's rows, so that no dense copy of
the weight is ever resident: only the packed result and one chunk's temporaries. The layout is separable
along rows (in groups of :data:`~nmcompile.kernels.cpu24.GROUP`) and along the reduction dim (in words of
16), so a ``Linear`` weight ``[out, in]`` is read by rows and a GPT-2 ``Conv1D`` weight ``[in, out]`` (2:4
along dim 0, held as its transpose) by runs of ``in``. :func:`read_dense` reads the other tensors, cast
chunk by chunk where a dtype is asked for.

:class:`PackedStateFile` is the other source a directory can hold: the packed state dict ``save_pretrained``
writes (``model_packed.pt``, 2:4 weights as :func:`nmcompile.pack`'s values and positions), read through the
same calls (dense shapes and reads) and, for its packed entries, straight into the CPU layout.
:func:`build_on_meta` builds the model the stream fills, nothing allocated.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..kernels import cpu24
from ..kernels.format24 import META_SUFFIX, Packed24, lost_metadata, packed_dims, unpack
from ..state import memory
from ..kernels.cpu24.weight import PackedLinearWeight
from .weight_files import SafetensorsFile

__all__ = ["read_packed", "read_dense", "chunk_budget", "packable", "PackedStateFile", "build_on_meta"]

#: elements per chunk at most (1 MiB of bf16 rows: the temporaries of one chunk stay a few MiB)
MAX_CHUNK = 1 << 19
MIN_CHUNK = 1 << 12


def chunk_budget(packed_elements: int) -> int:
    """Elements read per chunk for a model whose packed weights hold ``packed_elements`` dense elements:
    small next to the packed model (its 1/1024: the temporaries of a chunk take some 12 bytes an element),
    within [:data:`MIN_CHUNK`, :data:`MAX_CHUNK`]."""
    return max(MIN_CHUNK, min(MAX_CHUNK, packed_elements // 1024))


def packable(shape: tuple[int, ...], dim: int, dtype: torch.dtype) -> str | None:
    """Why a 2:4 weight of ``shape`` (grouped along ``dim``) cannot be held packed on the CPU, or None."""
    if len(shape) != 2 or dim not in (0, 1, -1, -2):
        return f"a {len(shape)}-D weight grouped along dim {dim} (the 2:4 CPU kernel takes linear weights)"
    if dtype not in cpu24.DTYPES:
        return f"dtype {dtype} (the 2:4 CPU kernel takes {', '.join(str(d) for d in cpu24.DTYPES)})"
    if shape[dim] % 16:
        return f"its reduction dim ({shape[dim]}) is not a multiple of 16"
    return None


def read_dense(source: SafetensorsFile, key: str, dtype: torch.dtype | None, budget: int) -> torch.Tensor:
    """Tensor ``key`` of ``source``, cast to ``dtype`` (floating tensors; None: as stored) chunk by chunk."""
    stored, shape = source.dtype(key), source.shape(key)
    if dtype is None or dtype == stored or not stored.is_floating_point or not shape:
        tensor = source.read(key)
        return tensor if dtype is None or not stored.is_floating_point else tensor.to(dtype)
    out = torch.empty(shape, dtype=dtype)
    step = max(1, budget // max(1, out[0].numel()))
    for first in range(0, shape[0], step):
        stop = min(shape[0], first + step)
        out[first:stop] = source.read(key, (first, stop))
    return out


def read_packed(source: SafetensorsFile, key: str, dtype: torch.dtype | None, transposed: bool,
                budget: int) -> tuple[PackedLinearWeight, int, int]:
    """``(packed weight, groups that keep more than 2 of 4, groups)`` of the 2-D 2:4 weight ``key``.

    ``transposed``: the stored weight is ``[in, out]`` (2:4 along dim 0, GPT-2's ``Conv1D``); the result
    is then the transposed view of the packed ``[out, in]`` weight, as :func:`nmcompile.deploy.pack_weights`
    makes it. A group with more than two non-zeros is counted (and its first two kept): the caller
    refuses the weight when the count is not zero."""
    stored = source.shape(key)
    dtype = dtype or source.dtype(key)
    out_f, in_f = (stored[1], stored[0]) if transposed else stored
    group = cpu24.GROUP
    values = torch.empty(-(-out_f // group), in_f // 16, group, 8, dtype=dtype)
    bits = torch.empty(values.shape[:3], dtype=torch.int16)
    bad = 0
    if transposed:  # file rows are runs of `in`: fill word columns of the layout
        step = max(16, budget // max(1, out_f) // 16 * 16)
        for first in range(0, in_f, step):
            stop = min(in_f, first + step)
            v, b, over = cpu24.cpu_pack(source.read(key, (first, stop)).to(dtype).t())
            values[:, first // 16:stop // 16] = v
            bits[:, first // 16:stop // 16] = b
            bad += over
            del v, b
    else:  # file rows are output rows: fill row groups of the layout
        step = max(group, budget // max(1, in_f) // group * group)
        for first in range(0, out_f, step):
            stop = min(out_f, first + step)
            v, b, over = cpu24.cpu_pack(source.read(key, (first, stop)).to(dtype))
            values[first // group:first // group + v.shape[0]] = v
            bits[first // group:first // group + b.shape[0]] = b
            bad += over
            del v, b
    memory.trim_heap()  # the chunks' temporaries were freed between long-lived packed weights
    weight = PackedLinearWeight(values, bits, (out_f, in_f), -1, cpu24.best_isa(dtype) or "", transposed)
    return weight, bad, out_f * in_f // 4



#: torch's constructors whose floating results take the default dtype when given none
_CONSTRUCTORS = frozenset({torch.empty, torch.empty_strided, torch.zeros, torch.ones, torch.full, torch.rand,
                           torch.randn, torch.arange, torch.linspace, torch.logspace, torch.eye, torch.scalar_tensor,
                           torch.tensor})


class _DefaultDtype(TorchFunctionMode):
    """``torch.set_default_dtype(dtype)`` for the thread that enters it only: a floating tensor that one of
    torch's constructors makes in the default dtype, given no dtype, is made in ``dtype``.

    The default dtype is process-wide: setting it while a model is built (as transformers' ``from_config(
    dtype=...)`` does) gives a model that another thread builds meanwhile that dtype, and two loads that
    overlap can leave the process with the other's. A function mode, as ``torch.device`` is, lives on this
    thread's mode stack only."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CONSTRUCTORS and kwargs.get("dtype") is None and isinstance(out, torch.Tensor) \
                and out.dtype == torch.get_default_dtype() != self.dtype \
                and not (func is torch.tensor and args and hasattr(args[0], "dtype")):  # a tensor's or array's own
            out = out.to(self.dtype)
        return out


def build_on_meta(cls, config, dtype: torch.dtype) -> nn.Module:
    """``cls`` built from ``config`` in ``dtype``, every tensor on the meta device (nothing is allocated or
    initialized), by contexts that only this thread sees: ``torch.device("meta")`` and :class:`_DefaultDtype`.
    Nothing process-wide changes, so other threads may build models or load meanwhile (an earlier version
    replaced ``nn.Module.register_parameter`` for the duration, and another thread's models got meta weights)."""
    build = getattr(cls, "_from_config", None) or cls.from_config  # the Auto classes: from_config
    with torch.device("meta"), _DefaultDtype(dtype):
        model = build(config, dtype=None)  # dtype=None: transformers would set the process's default dtype
    for sub in (config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", None) or ())):
        if sub is not None:  # what from_config(dtype=...) records
            sub.dtype = dtype
    return model


class PackedStateFile:
    """A packed state dict file (``model_packed.pt``) as a source of the stream: ``keys``, ``shape``, ``dtype`` and
    ``read`` as :class:`~nmcompile.checkpoint.weight_files.SafetensorsFile` gives them (the dense tensor's; a packed
    entry is unpacked where it is read), and :meth:`packed` for the entries stored packed.

    The file is read whole (its bytes are the packed model's), and each entry is handed over once read: a packed
    entry's bytes are freed once it is in the kernel's layout, a dense one becomes the parameter itself, so the
    load peaks at about the packed bytes plus one weight (a memory-mapped read would keep every page it touched
    resident until the end: 2.2x)."""

    def __init__(self, path) -> None:
        self.path = os.fspath(path)
        try:
            self.state = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as err:  # a torch.load of a damaged or foreign file raises many kinds
            raise ValueError(f"{self.path}: not a packed state dict ({type(err).__name__}: {str(err)[:200]}); write "
                             "the directory again with nmcompile.deploy.save_pretrained") from None
        lost = lost_metadata(self.state) if hasattr(self.state, "keys") else ["(not a state dict)"]
        if lost:
            raise ValueError(f"{self.path}: the packed state dict is damaged: {', '.join(lost[:3])} lost its "
                             f"{META_SUFFIX} entry; write the directory again with nmcompile.deploy.save_pretrained")
        self.dims = packed_dims(self.state)
        self.entries = {key: (self._shape(key), self.state[key].dtype) for key in self.state
                        if not key.endswith(META_SUFFIX)}

    def keys(self) -> list[str]:
        return list(self.entries)

    def _shape(self, name: str) -> tuple[int, ...]:
        values, meta = self.state[name], self.state.get(name + META_SUFFIX)
        if meta is None:
            return tuple(values.shape)
        shape = (*values.shape[:-1], values.shape[-1] * 2)
        return shape[::-1] if self.dims.get(name) == 0 else shape

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][1]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Dense tensor ``name`` (or its leading-dim slice ``rows``); the whole of a dense entry is handed over."""
        values, meta = self.state[name], self.state.get(name + META_SUFFIX)
        first, stop = rows if rows is not None else (0, self.shape(name)[0])
        if meta is None:
            if rows is None:
                return self.state.pop(name)
            return values[first:stop].clone()
        if self.dims.get(name) == 0:  # held as its transpose: rows of the file's layout are columns here
            return unpack(Packed24(values, meta), check=False).t()[first:stop].contiguous()
        return unpack(Packed24(values[first:stop], meta[first:stop]), check=False)

    def packed(self, name: str, dtype: torch.dtype | None) -> PackedLinearWeight | None:
        """Entry ``name`` in the CPU kernel's layout (in ``dtype``; None: as stored), its file bytes freed, or None
        where it is stored dense. A packed entry keeps at most 2 of every 4 by construction: nothing to count."""
        if name + META_SUFFIX not in self.state:
            return None
        values, meta = self.state.pop(name), self.state.pop(name + META_SUFFIX)
        values = values.to(dtype or values.dtype)
        v, b = cpu24.cpu_layout(values, meta)
        shape, isa = (values.shape[0], values.shape[1] * 2), cpu24.best_isa(values.dtype) or ""
        del values, meta
        memory.trim_heap()  # the file's bytes of this entry, freed between long-lived packed weights
        return PackedLinearWeight(v, b, shape, -1, isa, self.dims.get(name) == 0)
