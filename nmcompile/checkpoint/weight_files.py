"""The weights files of a model directory, read one tensor (or a run of rows) at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape
and byte range; free-form ``__metadata__`` strings) and the tensors' bytes. :class:`SafetensorsFile` reads
the header and, on request, one tensor or a range of its leading rows with plain reads into a fresh
tensor: nothing else of the file is resident, and no page of it is mapped into the process (a mapped
file's pages would count in its resident memory). :func:`stamp_safetensors` rewrites a file's metadata;
:func:`write_safetensors` writes a file one tensor at a time, each made only when its bytes are written.
Hugging Face directories hold ``model.safetensors``, or shards listed by
``model.safetensors.index.json``; :func:`weight_files` finds them.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from math import prod

import torch

__all__ = ["SafetensorsFile", "weight_files", "safetensors_metadata", "stamp_safetensors", "tensor_sources",
           "write_safetensors"]

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: a header larger than this is not a safetensors file (the format's own limit is 100 MB)
MAX_HEADER = 100 * 1024 * 1024
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def _header(handle, path: str) -> tuple[dict, int]:
    """``(header, offset of the data)``; ValueError naming ``path`` for anything else."""
    raw = handle.read(8)
    if len(raw) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length; truncated?)")
    (size,) = struct.unpack("<Q", raw)
    if size > MAX_HEADER:
        raise ValueError(f"{path}: not a safetensors file (a header length of {size} bytes)")
    try:
        header = json.loads(handle.read(size))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return header, 8 + size


def safetensors_metadata(path) -> dict[str, str]:
    """The ``__metadata__`` strings of a safetensors file (``{}`` if it has none)."""
    path = os.fspath(path)
    with open(path, "rb") as handle:
        header, _ = _header(handle, path)
    metadata = header.get("__metadata__") or {}
    return dict(metadata) if isinstance(metadata, dict) else {}


def stamp_safetensors(path, metadata: dict[str, str]) -> None:
    """Add ``metadata`` (strings) to a safetensors file's ``__metadata__``, in place.

    The file is written again next to itself (the header grows, the tensors' bytes are copied in
    chunks, never held) and renamed over the old one, so it is whole at every moment."""
    path = os.fspath(path)
    with open(path, "rb") as src:
        header, start = _header(src, path)
        merged = dict(header.get("__metadata__") or {})
        merged.update({str(k): str(v) for k, v in metadata.items()})
        header["__metadata__"] = merged
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as the writers keep it
        temporary = path + ".nmcompile-tmp"
        try:
            with open(temporary, "wb") as dst:
                dst.write(struct.pack("<Q", len(text)))
                dst.write(text)
                src.seek(start)
                shutil.copyfileobj(src, dst, 16 * 1024 * 1024)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)


def write_safetensors(path, entries, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file of ``entries``: ``(name, dtype, shape, make)`` each, ``make()`` giving the
    tensor (called when its bytes are written, so one entry's tensor is resident at a time). A tensor that is
    not of the dtype and shape its entry said is a ValueError (the header was written for it)."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    header, offset = {}, 0
    for name, dtype, shape, _ in entries:
        size = prod(shape) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(os.fspath(path), "wb") as handle:
        handle.write(struct.pack("<Q", len(text)))
        handle.write(text)
        for name, dtype, shape, make in entries:
            tensor = make()
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"write_safetensors: {name!r} is {tensor.dtype} {list(tensor.shape)}, its entry says "
                                 f"{dtype} {list(shape)}")
            handle.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


class SafetensorsFile:
    """One safetensors file: its tensors' names, shapes and dtypes, and reads of one tensor or rows of it."""

    def __init__(self, path) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as handle:
            header, self.start = _header(handle, self.path)
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        size = os.path.getsize(self.path)
        for name, entry in header.items():
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(int(s) for s in entry["shape"])
                begin, end = (int(v) for v in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{self.path}: the header entry of {name!r} is {entry!r}, not a tensor this reader "
                                 f"takes (dtypes {', '.join(DTYPES)})") from None
            if end - begin != prod(shape) * dtype.itemsize or self.start + end > size:
                raise ValueError(f"{self.path}: {name!r} ({entry['dtype']} {list(shape)}) does not fit its byte range "
                                 f"{begin}..{end} in a file of {size} bytes (truncated?)")
            self.entries[name] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][0]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name``, or its leading-dim slice ``rows`` = ``(first, end)``, as a new CPU tensor."""
        dtype, shape, begin, end = self.entries[name]
        if rows is not None:
            row_bytes = prod(shape[1:]) * dtype.itemsize
            first, stop = rows
            begin, end, shape = begin + first * row_bytes, begin + stop * row_bytes, (stop - first, *shape[1:])
        out = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(self.start + begin)
            view, done = memoryview(out.numpy()), 0
            while done < len(view):
                got = handle.readinto(view[done:])
                if not got:
                    raise ValueError(f"{self.path}: ends inside {name!r} (truncated?)")
                done += got
        return out.view(dtype).reshape(shape)


def weight_files(directory, required: bool = True) -> list[str]:
    """The safetensors files of a Hugging Face model directory: ``model.safetensors``, or the shards
    that ``model.safetensors.index.json`` lists. None found: ValueError (``required``) or ``[]``."""
    directory = os.fspath(directory)
    single, index = os.path.join(directory, SINGLE), os.path.join(directory, INDEX)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                mapping = json.load(handle)["weight_map"]
            shards = list(dict.fromkeys(mapping.values()))
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as err:
            raise ValueError(f"{index}: not a safetensors index (a 'weight_map' of names to shard files): {err}") from None
        files = [os.path.join(directory, shard) for shard in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{index} lists shards that are missing: {', '.join(missing[:3])}")
        return files
    if required:
        raise ValueError(f"{directory} holds no {SINGLE} nor {INDEX}: not a Hugging Face model directory saved with "
                         "safetensors (model.save_pretrained(path) writes one)")
    return []


def tensor_sources(files) -> dict[str, SafetensorsFile]:
    """``{tensor name: the file that holds it}`` over ``files`` (a name in two files is a ValueError)."""
    sources: dict[str, SafetensorsFile] = {}
    for path in files:
        handle = SafetensorsFile(path)
        for name in handle.keys():
            if name in sources:
                raise ValueError(f"{name!r} is in both {sources[name].path} and {path}")
            sources[name] = handle
    return sources
