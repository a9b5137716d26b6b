"""The packed 2:4 format: the kept values plus 2-bit position metadata, on any device.

A 2:4 weight ``[..., K]`` (groups of 4 along the last dim, at most 2 non-zeros each) packs into

- ``values`` ``[..., K/2]``: the two kept entries of each group, in order (a group with fewer than
  two non-zeros keeps zeros at its first free positions), in the weight's dtype;
- ``meta`` ``[..., K/16]`` ``int16``: per group one nibble ``i0 | i1 << 2`` (``i0 < i1``, the kept
  positions), four groups per 16-bit word, the lowest nibble first.

That is the metadata encoding of NVIDIA's sparse tensor cores and of PyTorch's CUTLASS 2:4 kernels
before their tile reordering (:meth:`Packed24.cutlass` applies it), so the format converts to
what the GPU kernels take without touching the values. For fp16/bf16 it takes 9/16 = 56.25% of
the dense bytes. :func:`pack_state_dict` / :func:`unpack_state_dict` do the same for checkpoints.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .. import masks
from .cpu24.weight import PackedLinearWeight

__all__ = ["Packed24", "pack", "unpack", "cutlass_meta", "row_meta", "pack_state_dict", "unpack_state_dict", "packed_dims",
           "lost_metadata"]

META_SUFFIX = ".nm24_meta"
#: the entry of a packed state dict's ``_metadata`` that lists its packed weights (see :func:`pack_state_dict`)
PACKED_RECORD = "nmcompile.nm24"
GROUPS_PER_WORD = 4
#: said where a dict without :func:`pack_state_dict`'s record is found damaged by its entries alone
DAMAGED_HINT = (" (found from the entries: the dict has no record of what was packed, which a dict rebuilt by a "
                "comprehension loses; a dense weight that only looks like a packed one loads where the record is kept: "
                "new = type(state)(...); new._metadata = state._metadata)")
#: the multiples CUTLASS's metadata order takes: rows by 32 (its row interleave) and the last dim
#: by 32 (two 16-bit words of four groups each: the words are swapped in pairs of columns and
#: stored ColumnMajorInterleaved<2>, so a last dim of 16 times an odd number has no place in it)
CUTLASS_ROWS, CUTLASS_COLS = 32, 32


@dataclass(frozen=True)
class Packed24:
    values: torch.Tensor  # [..., K/2]
    meta: torch.Tensor  # [..., K/16] int16

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.values.shape[:-1], self.values.shape[-1] * 2))

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.meta.numel() * self.meta.element_size()

    def cutlass(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, meta)`` in the layout ``torch._sparse_semi_structured_linear`` takes (2-D fp16/bf16,
        rows and last dim divisible by 32): the same values, the metadata words in CUTLASS's
        interleaved order. PyTorch's CUTLASS kernels need the last dim by 64 on top of that."""
        if self.values.dim() != 2 or self.values.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"Packed24.cutlass: the CUTLASS layout takes 2-D fp16/bf16 weights, got {tuple(self.shape)} "
                f"{self.values.dtype}; cast the weight (w.half()) before nmcompile.pack"
            )
        return self.values, cutlass_meta(self.meta, what=f"Packed24.cutlass of a {list(self.shape)} weight")

    @classmethod
    def from_cutlass(cls, values: torch.Tensor, meta: torch.Tensor) -> "Packed24":
        """The inverse of :meth:`cutlass`: metadata in CUTLASS's order back to row order (any value dtype)."""
        return cls(values, row_meta(meta))


def _meta_offsets(meta: torch.Tensor, what: str) -> torch.Tensor:
    from torch.sparse._semi_structured_conversions import _calculate_meta_reordering_scatter_offsets

    if meta.dim() != 2 or meta.dtype != torch.int16:
        raise ValueError(f"{what}: the CUTLASS metadata order is defined for 2-D int16 metadata, got {tuple(meta.shape)} {meta.dtype}")
    rows, words = meta.shape
    cols = words * 4 * GROUPS_PER_WORD
    if rows % CUTLASS_ROWS or cols % CUTLASS_COLS:
        raise ValueError(
            f"{what}: the CUTLASS layout needs rows divisible by {CUTLASS_ROWS} and a last (reduction) dim divisible "
            f"by {CUTLASS_COLS} (its metadata words are interleaved in pairs), got {rows} rows and a last dim of "
            f"{cols}; pad the weight to those multiples (PyTorch's CUTLASS 2:4 kernels need the last dim by 64)"
        )
    return _calculate_meta_reordering_scatter_offsets(rows, words, torch.int16, meta.device)


def cutlass_meta(meta: torch.Tensor, what: str = "nmcompile cutlass_meta") -> torch.Tensor:
    """Row-order metadata ``[rows, K/16]`` (rows and ``K`` divisible by 32) in CUTLASS's interleaved
    order. ``what`` names the caller in errors."""
    reordered = torch.empty_like(meta)
    reordered.view(-1).scatter_(0, _meta_offsets(meta, what), meta.reshape(-1))
    return reordered


def row_meta(meta: torch.Tensor, what: str = "nmcompile row_meta") -> torch.Tensor:
    """CUTLASS-ordered metadata back in row order (the inverse of :func:`cutlass_meta`)."""
    return meta.reshape(-1).gather(0, _meta_offsets(meta, what)).view(meta.shape)


def _check_24(weight: torch.Tensor, what: str, values: bool = True) -> None:
    if weight.dim() < 1 or weight.shape[-1] % (4 * GROUPS_PER_WORD):
        raise ValueError(
            f"{what}: the last dim ({tuple(weight.shape)}) must be a multiple of 16 (four 2:4 groups per "
            "metadata word); pad the layer's input features"
        )
    if not values:
        return
    bad, total = masks.count_violations(weight, 2, 4, -1)
    if bad:
        raise ValueError(
            f"{what}: {bad}/{total} groups of 4 along the last dim keep more than 2 non-zeros; finalize the "
            "model first (nmcompile.finalize) or prune the weight with nmcompile.masks.prune(w, 2, 4, -1)"
        )


def _kept_positions(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(i0, i1)``, ``i0 < i1``: the positions :func:`pack` keeps in each group of 4 (last dim)."""
    # non-zeros first, then zeros, each in index order (a stable sort on == 0)
    order = torch.sort((groups == 0).to(torch.uint8), dim=-1, stable=True).indices[..., :2]
    return order.min(-1).values, order.max(-1).values


def pack(weight: torch.Tensor, check: bool = True) -> Packed24:
    """Pack a 2:4 weight (groups along the last dim) into values + metadata. Exact: see :func:`unpack`.

    ``check=False`` skips the count of groups with more than two non-zeros (a device-to-host sync):
    for the training kernels, whose operands are 2:4 by construction and which pack at every call.
    A group with more non-zeros then keeps its first two, silently; the shape is always checked."""
    _check_24(weight, "nmcompile.pack", values=check)
    groups = weight.unflatten(-1, (-1, 4))
    first, second = _kept_positions(groups)
    values = torch.stack([groups.gather(-1, first[..., None])[..., 0], groups.gather(-1, second[..., None])[..., 0]], -1)
    nibbles = (first | (second << 2)).to(torch.int32).unflatten(-1, (-1, GROUPS_PER_WORD))
    shifts = torch.arange(GROUPS_PER_WORD, device=weight.device, dtype=torch.int32) * 4
    words = (nibbles << shifts).sum(-1)
    meta = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)  # as signed 16-bit
    return Packed24(values.flatten(-2).contiguous(), meta.contiguous())


def unpack(packed: Packed24, check: bool = True) -> torch.Tensor:
    """The dense weight (zeros at the dropped positions) that :func:`pack` packed.

    Raises ValueError for metadata that :func:`pack` cannot have written: a group whose two
    positions are not ``i0 < i1``, or whose kept positions are not the ones ``pack`` picks for the
    unpacked group (non-zeros first, then the first zeros). Metadata in CUTLASS's order fails that
    whenever a moved word lands on a group with zeros; a permutation of words that each fit their
    new group is a valid packing of another weight and cannot be told apart. ``check=False`` asks only
    ``i0 < i1``: for values that may be zero at a kept position (int8 codes of small kept weights).
    """
    values, meta = packed.values, packed.meta
    if meta.dtype != torch.int16 or values.shape[-1] != meta.shape[-1] * 2 * GROUPS_PER_WORD:
        raise ValueError(
            f"nmcompile.unpack: values {tuple(values.shape)} and meta {tuple(meta.shape)} {meta.dtype} do not "
            "belong together; expected int16 meta with one word per 8 values"
        )
    words = meta.to(torch.int32) & 0xFFFF
    shifts = torch.arange(GROUPS_PER_WORD, device=meta.device, dtype=torch.int32) * 4
    nibbles = ((words[..., None] >> shifts) & 0xF).flatten(-2)  # one per group
    first, second = (nibbles & 3).long(), (nibbles >> 2).long()
    groups = values.unflatten(-1, (-1, 2))
    dense = torch.zeros((*groups.shape[:-1], 4), dtype=values.dtype, device=values.device)
    valid = first < second
    if bool(valid.all()):
        dense.scatter_(-1, torch.stack([first, second], -1), groups)
    if check and bool(valid.all()):
        expected = _kept_positions(dense)
        valid = (first == expected[0]) & (second == expected[1])
    if not bool(valid.all()):
        bad = int((~valid).sum())
        where = tuple(int(i) for i in (~valid).nonzero()[0])
        raise ValueError(
            f"nmcompile.unpack: the metadata is not nmcompile's packed layout: {bad}/{valid.numel()} groups of 4 "
            f"(the first at group index {where}) hold position codes that nmcompile.pack never writes (two "
            "positions i0 < i1 per group, the non-zeros first, then the first free zeros, words in row order). "
            "unpack takes what nmcompile.pack returned; metadata in CUTLASS's order (Packed24.cutlass, "
            "torch.sparse.to_sparse_semi_structured) or from another tool must be densified there and packed "
            "with nmcompile.pack"
        )
    return dense.flatten(-2)


def packed_record(state: Mapping) -> list[str] | None:
    """The names :func:`pack_state_dict` recorded as packed in ``state``, or None (no record)."""
    entry = _record_entry(state)
    return None if entry is None else [str(name) for name in entry["packed"]]


def _record_entry(state: Mapping) -> Mapping | None:
    metadata = getattr(state, "_metadata", None)
    entry = metadata.get(PACKED_RECORD) if isinstance(metadata, Mapping) else None
    if not isinstance(entry, Mapping) or not isinstance(entry.get("packed"), (list, tuple)):
        return None
    return entry


def packed_dims(state: Mapping) -> dict[str, int]:
    """``{name: grouping dim}`` of the weights :func:`pack_state_dict` recorded as packed in ``state``:
    -1 (the last dim), or 0 for a 2-D weight packed as its transpose (GPT-2's ``Conv1D``)."""
    entry = _record_entry(state)
    if entry is None:
        return {}
    transposed = set(entry.get("transposed") or ())
    return {str(name): 0 if name in transposed else -1 for name in entry["packed"]}


def _with_metadata(out: dict, state: Mapping, packed: list[str] | None,
                   transposed: list[str] | None = None) -> "OrderedDict[str, torch.Tensor]":
    """``out`` as an OrderedDict carrying ``state``'s ``_metadata`` (PyTorch's per-module versions),
    with the record of the packed names (and of those packed as their transpose) when ``packed`` is
    given, without it otherwise."""
    result = OrderedDict(out)
    metadata = getattr(state, "_metadata", None)
    metadata = OrderedDict(metadata) if isinstance(metadata, Mapping) else OrderedDict()
    metadata.pop(PACKED_RECORD, None)
    if packed:
        metadata[PACKED_RECORD] = {"packed": list(packed), **({"transposed": list(transposed)} if transposed else {})}
    if metadata:
        result._metadata = metadata
    return result


def _transposed_dim(tensor: torch.Tensor, dim: int) -> bool:
    """Whether grouping dim ``dim`` of ``tensor`` is packed as its transpose (2-D, dim 0)."""
    return tensor.dim() == 2 and dim in (0, -2)


def pack_state_dict(state: Mapping[str, torch.Tensor], names=None, *, dims: Mapping[str, int] | None = None
                    ) -> dict[str, torch.Tensor]:
    """A copy of ``state`` with the 2:4 weights ``names`` (default: every >= 2-D floating tensor
    that is 2:4 along its grouping dim) stored packed: ``name`` holds the values, ``name + '.nm24_meta'``
    the metadata. Exact: :func:`unpack_state_dict` gives ``state`` back.

    ``dims``: ``{name: grouping dim}`` where it is not the last dim: a 2-D weight 2:4 along dim 0
    (GPT-2's ``Conv1D``, ``[in, out]``) is packed as its transpose (``[out, in/2]`` values). Conv
    weights (last dim: the kernel width) stay dense. Packed-only weights
    (:class:`~nmcompile.kernels.cpu24.weight.PackedLinearWeight`) are written without unpacking,
    those held as a transpose as their transpose.

    The copy's ``_metadata`` (kept by ``torch.save``/``torch.load`` and ignored by
    ``load_state_dict``) lists the packed names under :data:`PACKED_RECORD` (and, under
    ``"transposed"``, those packed as their transpose), so that :func:`unpack_state_dict` and
    ``nmcompile check`` tell a file that lost a metadata entry from one with a dense weight. A name
    in ``names`` or ``dims`` that ``state`` does not hold, or that cannot be packed, is a ValueError."""
    dims = dict(dims or {})
    if names is not None:
        names = {names} if isinstance(names, str) else set(names)
    unknown = sorted((set(names or ()) | set(dims)) - set(state))
    if unknown:
        weights = [k for k, t in state.items() if isinstance(t, torch.Tensor) and t.dim() >= 2]
        raise ValueError(
            f"pack_state_dict: names {', '.join(map(repr, unknown))} are not in the state dict; pass names of its "
            f"entries (its >= 2-D tensors: {', '.join(weights[:5])}{' ...' if len(weights) > 5 else ''})"
        )
    out, packed_names, transposed_names = {}, [], []
    for key, tensor in state.items():
        if isinstance(tensor, PackedLinearWeight):
            out[key], out[key + META_SUFFIX] = tensor.packed()
            packed_names.append(key)
            if tensor.transposed:
                transposed_names.append(key)
            continue
        selected, asked = names is None or key in names, key in (names or ()) or key in dims
        if not (selected or asked):  # neither packed nor checked: never read (a 128k-word embedding's count took 3 GB)
            out[key] = tensor
            continue
        transposed = isinstance(tensor, torch.Tensor) and _transposed_dim(tensor, dims.get(key, -1))
        candidate = tensor.t() if transposed else tensor
        fits = (
            isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.is_floating_point()
            and candidate.shape[-1] % 16 == 0 and not masks.count_violations(candidate, 2, 4, -1)[0]
        )
        if asked and not fits:
            along = f"dim {dims[key]}" if key in dims else "its last dim"
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"pack_state_dict: {key!r} {shape} cannot be packed as 2:4 along {along} (it must be "
                             "a floating-point weight, 2:4 along that dim, whose size there is a multiple of 16)")
        if selected and fits:
            packed = pack(candidate, check=False)  # fits: counted above
            out[key], out[key + META_SUFFIX] = packed.values, packed.meta
            packed_names.append(key)
            if transposed:
                transposed_names.append(key)
        else:
            out[key] = tensor
    return _with_metadata(out, state, packed_names, transposed_names)


def _siblings(name: str) -> str:
    """``name`` with its numeric components (block and layer indices) as ``#``."""
    return ".".join("#" if part.isdigit() else part for part in name.split("."))


def lost_metadata(state: Mapping) -> list[str]:
    """The entries of a packed state dict that were written packed but lost their ``.nm24_meta`` entry.

    Where the dict carries :func:`pack_state_dict`'s record (``_metadata``), the names it records.
    Without it (a dict rebuilt by a comprehension or ``dict(state)``), from the entries themselves: an
    entry without metadata that has the shape and dtype of the values of a packed entry whose name
    differs from its own only in numeric components (the same layer of another block: ``layers.3.q.weight``
    beside a packed ``layers.2.q.weight``; a dense one has twice the values' last dim)."""
    recorded = packed_record(state)
    if recorded is not None:
        return [key for key in recorded if key in state and key + META_SUFFIX not in state]
    packed: dict[str, set] = {}
    for key in state:
        values = state.get(key[: -len(META_SUFFIX)]) if key.endswith(META_SUFFIX) else None
        if isinstance(values, torch.Tensor):
            packed.setdefault(_siblings(key[: -len(META_SUFFIX)]), set()).add((tuple(values.shape), values.dtype))
    return [key for key, tensor in state.items()
            if isinstance(tensor, torch.Tensor) and not key.endswith(META_SUFFIX) and key + META_SUFFIX not in state
            and (tuple(tensor.shape), tensor.dtype) in packed.get(_siblings(key), ())]


def unpack_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The dense state dict that :func:`pack_state_dict` packed (loads into the plain model); weights
    packed as their transpose are given back in their own layout (``[in, out]`` for GPT-2's ``Conv1D``).

    Raises ValueError for a damaged file: a metadata entry without its values, or a weight written
    packed whose metadata is missing (:func:`lost_metadata`; its half-width values would otherwise
    pass as a dense weight)."""
    lost = lost_metadata(state)
    orphans = [key for key in state if key.endswith(META_SUFFIX) and key[: -len(META_SUFFIX)] not in state]
    if lost or orphans:
        problems = [f"{key} was written packed but its metadata {key}{META_SUFFIX} is missing" for key in lost]
        problems += [f"{key} has no values entry {key[: -len(META_SUFFIX)]!r}" for key in orphans]
        raise ValueError(
            f"unpack_state_dict: the packed state dict is damaged: {'; '.join(problems[:3])}"
            f"{' ...' if len(problems) > 3 else ''}. Write it again with nmcompile.deploy.pack_state_dict(model.state_dict())"
            + ("" if packed_record(state) is not None else DAMAGED_HINT)
        )
    out, dims = {}, packed_dims(state)
    for key, tensor in state.items():
        if key.endswith(META_SUFFIX):
            continue
        meta = state.get(key + META_SUFFIX)
        if meta is None:
            out[key] = tensor
        else:
            dense = unpack(Packed24(tensor, meta))
            out[key] = dense.t().contiguous() if dims.get(key) == 0 else dense
    return _with_metadata(out, state, None)
