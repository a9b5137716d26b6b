"""Weights read from a safetensors file a run of rows at a time, packed 2:4 on the way in.

:func:`read_packed` fills a :class:`~nmcompile.kernels.cpu24.weight.PackedLinearWeight` (the CPU kernel's
layout, made by :func:`nmcompile.kernels.cpu24.cpu_pack`) from chunks of the file's rows, so that no dense copy of
the weight is ever resident: only the packed result and one chunk's temporaries. The layout is separable
along rows (in groups of :data:`~nmcompile.kernels.cpu24.GROUP`) and along the reduction dim (in words of
16), so a ``Linear`` weight ``[out, in]`` is read by rows and a GPT-2 ``Conv1D`` weight ``[in, out]`` (2:4
along dim 0, held as its transpose) by runs of ``in``. :func:`read_dense` reads the other tensors, cast
chunk by chunk where a dtype is asked for.
"""

from __future__ import annotations

import torch

from ..kernels import cpu24
from ..state import memory
from ..kernels.cpu24.weight import PackedLinearWeight
from .weight_files import SafetensorsFile

__all__ = ["read_packed", "read_dense", "chunk_budget", "packable"]

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
