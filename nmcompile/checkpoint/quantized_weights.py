"""2:4 weights with int8 or 4-bit values in a saved directory: codes, positions and scales beside the dense files.

A model whose 2:4 weights lie on recorded grids (a one-shot solve with ``bits=8`` or ``bits=4``, which finalize
records; or a model unpacked from such values by :func:`nmcompile.deploy.unpack_weights`) is saved as any model
is: the Hugging Face files hold each weight dense, every kept value its code times its scale in the model's
dtype, so a plain ``from_pretrained`` loads a working model anywhere. Beside them, one file a width holds what the
CPU kernels read, one weight's tensors under its name::

    model_int8.safetensors (bits 8, about 5 bits a weight)
      <name>.codes   int8   [out, in/2]      the kept values' codes (-127..127), in nmcompile.pack's order
      <name>.meta    int16  [out, in/16]     their positions (nmcompile.pack's metadata)
      <name>.scales  fp32   [out]            each row's scale
    model_int4.safetensors (bits 4, 3.25 bits a weight at group 64)
      <name>.codes   uint8  [out, in/4]      two kept values a byte (the first in the low nibble), each its
                                             code -8..7 plus 8, in nmcompile.pack's order
      <name>.meta    int16  [out, in/16]     their positions
      <name>.scales  fp16   [out, in/group]  each row's scale per group of ``group`` positions (64 or 128;
                                             signed, 0 for a group of zeros)

(a GPT-2 ``Conv1D`` weight, 2:4 along dim 0, as its transpose ``[out, in]``). The layout record marks those
weights ``"bits": 8`` or ``4`` and names the files (``"int8": {"file": "model_int8.safetensors"}``, ``"int4":
{...}``). ``load_pretrained(DIR, packed=True)`` reads them straight into packed weights, not reading the dense
files' copies; a dense load records each weight's grid, so :func:`nmcompile.deploy.pack_weights` holds them on
it again; ``nmcompile check DIR`` checks that the codes are 2:4 and on the grid and that the dense files hold
code times scale.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from ..kernels import cpu24
from ..kernels.cpu24.quantize import GROUP_SIZES, HIGH4, LOW4, grid_codes, on_grid, quantize_layout4
from ..kernels.cpu24.weight import PackedLinearWeight
from ..kernels.format24 import Packed24, pack, unpack
from ..state import records
from ..state.records import owners
from ..state.sharding import full
from .layout import INT4_FILE, INT8_FILE, Layout
from .weight_files import SafetensorsFile, write_safetensors

__all__ = ["INT8_FILE", "INT4_FILE", "FILES", "WIDTHS", "grids_of", "write_codes", "CodesFile", "record_grids", "check_against"]

#: the file of each width's codes
FILES = {8: INT8_FILE, 4: INT4_FILE}
#: the record each width's grid sits under on a module
_RECORDS = {8: records.INT8, 4: records.INT4}
#: each width as messages name it
WIDTHS = {8: "int8", 4: "4-bit"}


def grids_of(model: nn.Module, layout: Layout) -> dict[str, tuple[int, Tensor]]:
    """``{name: (bits, scales)}`` of the layout's 2-D weights that hold a recorded grid: int8 (fp32 scales
    ``[out]``) or 4-bit (fp16 scales ``[out, in/group]``). A 3-D weight (fused experts) keeps float values only:
    the kernels do not take it."""
    out = {}
    for name, places in owners(model):
        _, module, pname = places[0]
        entry = layout.weights.get(name)
        if entry is None or len(entry.shape) != 2:
            continue
        for bits, key in _RECORDS.items():
            grid = records.get(module, key, pname)
            if grid is not None:
                out[name] = (bits, grid.float() if bits == 8 else grid.to(torch.float16))
                break
    return out


def _rows(weight: Tensor, dim: int) -> Tensor:
    """``weight`` as ``[out, in]`` (the transpose of a weight 2:4 along dim 0)."""
    return weight.t() if dim in (0, -2) else weight


def _spread(scales: Tensor, kept: int) -> Tensor:
    """fp32 ``[out, kept]``: each kept value's scale (a row's, or its group's: ``kept / groups`` values a group)."""
    s = scales.float()
    return s[:, None].expand(-1, kept) if s.dim() == 1 else s.repeat_interleave(kept // s.shape[1], dim=1)


def _codes4(kept: Tensor, scales: Tensor) -> tuple[Tensor, int]:
    """``(uint8 [out, kept/2] two offset codes a byte, values off the grid)`` of kept values ``[out, kept]`` on the
    4-bit group ``scales``; a value in a group of scale 0 is off unless it is 0."""
    d = _spread(scales, kept.shape[1])
    steps = kept.float() / torch.where(d != 0, d, 1.0)
    codes = torch.where(d != 0, torch.round(steps), 0.0)
    off = ((steps - codes).abs() > on_grid(kept.dtype)) | (codes < LOW4) | (codes > HIGH4) | ((d == 0) & (kept != 0))
    nib = (codes.clamp_(LOW4, HIGH4) + 8).to(torch.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4), int(off.sum())


def _codes(name: str, weight: Tensor, bits: int, scales: Tensor) -> tuple[Tensor, Tensor]:
    """``(codes, meta)`` of a 2:4 ``[out, in]`` weight on the grid of ``scales``; ValueError naming the weight
    where a value is off it."""
    packed = pack(weight)
    codes, off = grid_codes(packed.values, scales[:, None]) if bits == 8 else _codes4(packed.values, scales)
    if off:
        raise ValueError(
            f"nmcompile.deploy.save_pretrained: {off} kept values of {name} are not on the {WIDTHS[bits]} grid recorded "
            f"for it (the weight changed after it was solved or packed with bits={bits}), so its codes would not be "
            f"the weight the files hold; prune it again with bits={bits}, or pack_weights(model, bits={bits}) (round "
            "to nearest) and unpack_weights(model) to record the new grid, or drop the grids to save float values only")
    return codes, packed.meta


def _shapes(bits: int, out_f: int, in_f: int, groups: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{suffix: (dtype, shape)}`` of one weight's tensors in the ``bits`` file."""
    if bits == 8:
        return {"codes": (torch.int8, (out_f, in_f // 2)), "meta": (torch.int16, (out_f, in_f // 16)),
                "scales": (torch.float32, (out_f,))}
    return {"codes": (torch.uint8, (out_f, in_f // 4)), "meta": (torch.int16, (out_f, in_f // 16)),
            "scales": (torch.float16, (out_f, groups))}


def write_codes(model: nn.Module, layout: Layout, grids: dict[str, tuple[int, Tensor]], directory: str) -> list[str]:
    """Write the codes files (:data:`FILES`) in ``directory`` for the weights of ``grids`` (:func:`grids_of`), one
    weight resident at a time, and mark them in ``layout`` (``bits``, the files); the files written."""
    params = {name: places[0][1]._parameters[places[0][2]] for name, places in owners(model)}
    written = []
    for width, file in FILES.items():
        entries = []
        for name, (bits, scales) in grids.items():
            if bits != width:
                continue
            entry = layout.weights[name]
            out_f, in_f = _rows(torch.empty(entry.shape, device="meta"), entry.dim).shape
            group = in_f // scales.shape[1] if bits == 4 and scales.dim() == 2 and scales.shape[1] else 0
            expected = (out_f,) if bits == 8 else (out_f, in_f // group if group else -1)
            if tuple(scales.shape) != expected or in_f % 16 or (bits == 4 and group not in GROUP_SIZES):
                raise ValueError(f"nmcompile.deploy.save_pretrained: {name} {list(entry.shape)} has a {WIDTHS[bits]} grid "
                                 f"of {list(scales.shape)} scales (expected "
                                 f"{'one a row' if bits == 8 else f'one a row and group of {GROUP_SIZES}'}) or a "
                                 f"reduction dim ({in_f}) that is not a multiple of 16; it cannot be written with "
                                 f"{WIDTHS[bits]} values")
            made: dict[str, Tensor] = {}

            def codes(name=name, scales=scales, entry=entry, made=made, bits=bits):
                made["codes"], made["meta"] = _codes(name, _rows(full(params[name].detach()), entry.dim), bits, scales)
                return made["codes"]

            shapes = _shapes(bits, out_f, in_f, scales.shape[-1])
            entries += [(f"{name}.codes", *shapes["codes"], codes),
                        (f"{name}.meta", *shapes["meta"], lambda made=made: made.pop("meta")),
                        (f"{name}.scales", *shapes["scales"], lambda scales=scales: scales.contiguous())]
            layout.weights[name] = entry.with_bits(bits)
        if entries:
            write_safetensors(os.path.join(directory, file), entries)
            setattr(layout, f"int{width}", {"file": file})
            written.append(file)
    return written


class CodesFile:
    """The codes file of a saved directory for weights of ``bits`` 8 or 4 (:data:`FILES`), read one weight at a
    time and checked."""

    def __init__(self, directory: str, layout: Layout, bits: int):
        name = (getattr(layout, f"int{bits}") or {}).get("file") or FILES[bits]
        self.path, self.bits, self.layout = os.path.join(directory, name), bits, layout
        wanted = [n for n, w in layout.weights.items() if w.bits == bits]
        if not os.path.isfile(self.path):
            raise ValueError(f"{directory}: its layout record says {', '.join(wanted[:3])} hold {WIDTHS[bits]} values in "
                             f"{name}, which is missing; copy the whole directory, or save the model again with "
                             "nmcompile.deploy.save_pretrained")
        self.file = SafetensorsFile(self.path)

    def scales(self, name: str) -> Tensor:
        out_f, in_f = self._shape(name)
        key = f"{name}.scales"
        groups = self.file.shape(key)[-1] if self.bits == 4 and key in self.file.entries else 0
        if self.bits == 4 and (not groups or in_f % groups or in_f // groups not in GROUP_SIZES):
            raise ValueError(f"{self.path}: {key!r} is {list(self.file.shape(key)) if groups else 'missing'}; the "
                             f"scales of a 4-bit weight with {in_f} inputs cover groups of {GROUP_SIZES} positions; "
                             "save the model again")
        scales = self._read(key, _shapes(self.bits, out_f, in_f, groups)["scales"])
        ok = torch.isfinite(scales) & (scales > 0 if self.bits == 8 else True)
        if not bool(ok.all()):
            raise ValueError(f"{self.path}: the scales of {name} are not all finite"
                             f"{' and positive' if self.bits == 8 else ''} (a damaged file); save the model again")
        return scales

    def read(self, name: str) -> tuple[Tensor, Tensor, Tensor]:
        """``(codes, meta, scales)`` of ``name``, checked: shapes, codes within the grid."""
        scales = self.scales(name)
        shapes = _shapes(self.bits, *self._shape(name), scales.shape[-1])
        codes, meta = self._read(f"{name}.codes", shapes["codes"]), self._read(f"{name}.meta", shapes["meta"])
        if self.bits == 8 and bool((codes == -128).any()):
            raise ValueError(f"{self.path}: {name} holds the code -128, outside the symmetric grid -127..127 "
                             "(a damaged file); save the model again")
        return codes, meta, scales

    def kept(self, name: str) -> tuple[Tensor, Tensor, Tensor]:
        """``(fp32 kept values [out, in/2], meta, scales)``: each code times its scale."""
        codes, meta, scales = self.read(name)
        if self.bits == 4:
            codes = torch.stack([codes & 0x0F, codes >> 4], dim=2).flatten(1).to(torch.int8) - 8
        return codes.float() * _spread(scales, codes.shape[1]), meta, scales

    def packed(self, name: str, dtype: torch.dtype, isa: str) -> PackedLinearWeight:
        """``name`` as a packed weight of codes computing in ``dtype`` on ``isa`` (no dense copy made)."""
        kept, meta, scales = self.kept(name) if self.bits == 4 else self.read(name)
        try:
            values, bits = cpu24.cpu_layout(kept, meta)
        except ValueError as err:
            raise ValueError(f"{self.path}: the positions of {name} are damaged ({err})") from None
        out_f, in_f = self._shape(name)
        if self.bits == 4:  # the kept values, exactly code times scale in fp32, back on their grid
            found = quantize_layout4(values, bits, out_f, in_f // scales.shape[1], scales)
            if found is None:
                raise ValueError(f"{self.path}: the codes of {name} do not lie on their grid (a damaged file); "
                                 "save the model again")
            values, bits, scales = found
        transposed = self.layout.weights[name].dim in (0, -2)
        return PackedLinearWeight(values, bits, (out_f, in_f), -1, isa, transposed, scales, dtype)

    def dense(self, name: str) -> Tensor:
        """The fp32 ``[out, in]`` weight the codes make (code times scale), for checks."""
        kept, meta, _ = self.kept(name)
        return unpack(Packed24(kept, meta), check=False)

    def tolerance(self, name: str, dtype: torch.dtype) -> Tensor:
        """fp32 ``[out, in or 1]``: how far a value stored in ``dtype`` may lie from the codes' (:func:`on_grid`
        steps of its scale)."""
        scales = self.scales(name).float().abs()
        return on_grid(dtype) * (scales[:, None] if self.bits == 8 else
                                 scales.repeat_interleave(self._shape(name)[1] // scales.shape[1], dim=1))

    def _shape(self, name: str) -> tuple[int, int]:
        entry = self.layout.weights[name]
        return tuple(_rows(torch.empty(entry.shape, device="meta"), entry.dim).shape)

    def _read(self, key: str, spec: tuple[torch.dtype, tuple[int, ...]]) -> Tensor:
        dtype, shape = spec
        if key not in self.file.entries:
            raise ValueError(f"{self.path} has no {key!r}: the file and the layout record come from different saves; "
                             "save the model again")
        if self.file.dtype(key) != dtype or tuple(self.file.shape(key)) != tuple(shape):
            raise ValueError(f"{self.path}: {key!r} is {self.file.dtype(key)} {list(self.file.shape(key))}, the layout "
                             f"record makes it {dtype} {list(shape)}; save the model again")
        return self.file.read(key)


def codes_files(directory: str, layout: Layout) -> dict[int, CodesFile]:
    """``{bits: CodesFile}`` for each width the layout marks on some weight."""
    widths = sorted({w.bits for w in layout.weights.values() if w.bits}, reverse=True)
    return {bits: CodesFile(directory, layout, bits) for bits in widths}


def record_grids(model: nn.Module, layout: Layout, directory: str) -> None:
    """Record on ``model`` (loaded dense) the grid of each weight the layout marks ``bits`` 8 or 4, from the
    directory's codes files, so that :func:`nmcompile.deploy.pack_weights` holds them on it again."""
    places = dict(owners(model))
    for bits, found in codes_files(directory, layout).items():
        for name, entry in layout.weights.items():
            if entry.bits == bits:
                scales = found.scales(name)
                for _, module, pname in places.get(layout.canonical(name), ()):
                    records.put(module, _RECORDS[bits], pname, scales)


def check_against(found: CodesFile, name: str, stored: Tensor) -> str:
    """What is wrong with the codes of ``name`` against ``stored`` (the dense files' weight), or ``""``: damaged
    codes or positions, or a stored weight that is not code times scale (within :func:`on_grid` steps of its
    dtype)."""
    try:
        weight = found.dense(name)
        tolerance = found.tolerance(name, stored.dtype)
    except ValueError as err:
        return f"{WIDTHS[found.bits]} codes: {err}"
    rows = _rows(stored.float(), found.layout.weights[name].dim)
    off = ((rows - weight).abs() > tolerance).sum()
    if int(off):
        return (f"{int(off)} values of the weights file are not the {WIDTHS[found.bits]} codes of {found.path} times "
                "their scale (the files come from different saves?)")
    return ""
