"""2:4 weights with int8 values in a saved directory: codes, positions and row scales beside the dense files.

A model whose 2:4 weights lie on per-row int8 grids (a one-shot solve with ``bits=8``, which finalize records;
or a model unpacked from int8 by :func:`nmcompile.deploy.unpack_weights`) is saved as any model is: the
Hugging Face files hold each weight dense, every kept value its code times its row's scale in the model's
dtype, so a plain ``from_pretrained`` loads a working model anywhere. Beside them, :data:`INT8_FILE` holds,
for each such weight, what the 2:4 int8 kernel reads (about 5 bits a weight)::

    <name>.codes   int8  [out, in/2]   the kept values' codes (-127..127), in nmcompile.pack's order
    <name>.meta    int16 [out, in/16]  their positions (nmcompile.pack's metadata)
    <name>.scales  fp32  [out]         each row's scale

(a GPT-2 ``Conv1D`` weight, 2:4 along dim 0, as its transpose ``[out, in]``). The layout record marks those
weights ``"bits": 8`` and names the file (``"int8": {"file": "model_int8.safetensors"}``).
``load_pretrained(DIR, packed=True)`` reads them straight into int8 packed weights, not reading the dense
files' copies; a dense load records each weight's grid, so :func:`nmcompile.deploy.pack_weights` holds them on
it again; ``nmcompile check DIR`` checks that the codes are 2:4 and on the grid and that the dense files hold
code times scale.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from ..kernels import cpu24
from ..kernels.cpu24.quantize import grid_codes, on_grid
from ..kernels.cpu24.weight import PackedLinearWeight
from ..kernels.format24 import Packed24, pack, unpack
from ..state import records
from ..state.records import owners
from ..state.sharding import full
from .layout import INT8_FILE, Layout
from .weight_files import SafetensorsFile, write_safetensors

__all__ = ["INT8_FILE", "grids_of", "write_int8", "Int8File", "record_grids"]


def grids_of(model: nn.Module, layout: Layout) -> dict[str, Tensor]:
    """``{name: fp32 scales [out]}`` of the layout's 2-D weights that hold a recorded int8 grid (a 3-D weight,
    fused experts, keeps float values only: the kernel does not take it)."""
    out = {}
    for name, places in owners(model):
        _, module, pname = places[0]
        if records.get(module, records.INT4, pname) is not None:
            raise NotImplementedError(
                f"nmcompile.deploy.save_pretrained: {name} holds a one-shot solve's 4-bit grid, which saved folders "
                "cannot record yet: its values would load back as float weights and pack_weights(bits=4) would round "
                "them again on a grid of its own, not the solve's. Serve it from this process "
                "(nmcompile.deploy.pack_weights(model)), or solve with bits=8 (saved with its grid) to save it")
        grid = records.get(module, records.INT8, pname)
        entry = layout.weights.get(name)
        if entry is not None and grid is not None and len(entry.shape) == 2:  # what the 2:4 int8 kernel takes
            out[name] = grid.float()
    return out


def _rows(weight: Tensor, dim: int) -> Tensor:
    """``weight`` as ``[out, in]`` (the transpose of a weight 2:4 along dim 0)."""
    return weight.t() if dim in (0, -2) else weight


def _codes(name: str, weight: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """``(codes, meta)`` of a 2:4 ``[out, in]`` weight on the grid of ``scales``; ValueError naming the weight
    where a value is off it."""
    packed = pack(weight)
    codes, off = grid_codes(packed.values, scales[:, None])
    if off:
        raise ValueError(
            f"nmcompile.deploy.save_pretrained: {off} kept values of {name} are not on the int8 grid recorded "
            "for it (the weight changed after it was solved or packed with bits=8), so its int8 codes would not be the "
            "weight the files hold; prune it again with bits=8, or pack_weights(model, bits=8) (round to nearest) and "
            "unpack_weights(model) to record the new grid, or drop the grids to save float values only")
    return codes, packed.meta


def write_int8(model: nn.Module, layout: Layout, grids: dict[str, Tensor], path: str) -> None:
    """Write :data:`INT8_FILE` at ``path`` for the weights of ``grids`` (:func:`grids_of`), one weight resident
    at a time, and mark them in ``layout`` (``bits``, the file)."""
    params = {name: places[0][1]._parameters[places[0][2]] for name, places in owners(model)}
    entries = []
    for name, scales in grids.items():
        entry = layout.weights[name]
        out_f, in_f = _rows(torch.empty(entry.shape, device="meta"), entry.dim).shape
        if scales.shape != (out_f,) or in_f % 16:
            raise ValueError(f"nmcompile.deploy.save_pretrained: {name} {list(entry.shape)} has an int8 grid of "
                             f"{list(scales.shape)} scales (one a row of its {out_f} outputs expected) or a reduction "
                             f"dim ({in_f}) that is not a multiple of 16; it cannot be written with int8 values")
        made: dict[str, Tensor] = {}

        def codes(name=name, scales=scales, entry=entry, made=made):
            made["codes"], made["meta"] = _codes(name, _rows(full(params[name].detach()), entry.dim), scales)
            return made["codes"]

        entries += [(f"{name}.codes", torch.int8, (out_f, in_f // 2), codes),
                    (f"{name}.meta", torch.int16, (out_f, in_f // 16), lambda made=made: made.pop("meta")),
                    (f"{name}.scales", torch.float32, (out_f,), lambda scales=scales: scales.contiguous())]
    write_safetensors(path, entries)
    for name in grids:
        layout.weights[name] = layout.weights[name].with_bits(8)
    layout.int8 = {"file": os.path.basename(path)}


class Int8File:
    """The int8 file of a saved directory (:data:`INT8_FILE`), read one weight at a time and checked."""

    def __init__(self, directory: str, layout: Layout):
        name = (layout.int8 or {}).get("file") or INT8_FILE
        self.path = os.path.join(directory, name)
        wanted = [n for n, w in layout.weights.items() if w.bits == 8]
        if not os.path.isfile(self.path):
            raise ValueError(f"{directory}: its layout record says {', '.join(wanted[:3])} hold int8 values in {name}, "
                             "which is missing; copy the whole directory, or save the model again with "
                             "nmcompile.deploy.save_pretrained")
        self.file = SafetensorsFile(self.path)
        self.layout = layout

    def scales(self, name: str) -> Tensor:
        out_f, _ = self._shape(name)
        scales = self._read(f"{name}.scales", torch.float32, (out_f,))
        if not bool((torch.isfinite(scales) & (scales > 0)).all()):
            raise ValueError(f"{self.path}: the scales of {name} are not all finite and positive (a damaged file); "
                             "save the model again")
        return scales

    def read(self, name: str) -> tuple[Tensor, Tensor, Tensor]:
        """``(codes, meta, scales)`` of ``name``, checked: shapes, codes within -127..127, valid positions."""
        out_f, in_f = self._shape(name)
        codes = self._read(f"{name}.codes", torch.int8, (out_f, in_f // 2))
        meta = self._read(f"{name}.meta", torch.int16, (out_f, in_f // 16))
        if bool((codes == -128).any()):
            raise ValueError(f"{self.path}: {name} holds the code -128, outside the symmetric grid -127..127 "
                             "(a damaged file); save the model again")
        return codes, meta, self.scales(name)

    def packed(self, name: str, dtype: torch.dtype) -> PackedLinearWeight:
        """``name`` as an int8 packed weight computing in ``dtype`` (no dense copy made)."""
        codes, meta, scales = self.read(name)
        try:
            values, bits = cpu24.cpu_layout(codes, meta)
        except ValueError as err:
            raise ValueError(f"{self.path}: the positions of {name} are damaged ({err})") from None
        entry = self.layout.weights[name]
        return PackedLinearWeight(values, bits, tuple(codes.shape[:1]) + (codes.shape[1] * 2,), -1,
                                  cpu24.best_isa(torch.int8) or "avx2", entry.dim in (0, -2), scales, dtype)

    def dense(self, name: str) -> Tensor:
        """The fp32 ``[out, in]`` weight the codes make (code times scale), for checks."""
        codes, meta, scales = self.read(name)
        return unpack(Packed24(codes.float() * scales[:, None], meta), check=False)

    def _shape(self, name: str) -> tuple[int, int]:
        entry = self.layout.weights[name]
        return tuple(_rows(torch.empty(entry.shape, device="meta"), entry.dim).shape)

    def _read(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        if key not in self.file.entries:
            raise ValueError(f"{self.path} has no {key!r}: the file and the layout record come from different saves; "
                             "save the model again")
        if self.file.dtype(key) != dtype or tuple(self.file.shape(key)) != tuple(shape):
            raise ValueError(f"{self.path}: {key!r} is {self.file.dtype(key)} {list(self.file.shape(key))}, the layout "
                             f"record makes it {dtype} {list(shape)}; save the model again")
        return self.file.read(key)


def record_grids(model: nn.Module, layout: Layout, directory: str) -> None:
    """Record on ``model`` (loaded dense) the int8 grid of each weight the layout marks ``bits`` 8, from the
    directory's int8 file, so that :func:`nmcompile.deploy.pack_weights` holds them on it again."""
    wanted = [name for name, w in layout.weights.items() if w.bits == 8]
    if not wanted:
        return
    found = Int8File(directory, layout)
    places = dict(owners(model))
    for name in wanted:
        scales = found.scales(name)
        for _, module, pname in places.get(layout.canonical(name), ()):
            records.put(module, records.INT8, pname, scales)


def check_against(found: Int8File, name: str, stored: Tensor) -> str:
    """What is wrong with the int8 codes of ``name`` against ``stored`` (the dense files' weight), or ``""``:
    damaged codes or positions, or a stored weight that is not code times scale (within :func:`on_grid` steps of
    its dtype)."""
    try:
        weight = found.dense(name)
        scales = found.scales(name)
    except ValueError as err:
        return f"int8 codes: {err}"
    rows = _rows(stored.float(), found.layout.weights[name].dim)
    off = ((rows - weight).abs() > on_grid(stored.dtype) * scales[:, None]).sum()
    if int(off):
        return (f"{int(off)} values of the weights file are not the int8 codes of {found.path} times their row's "
                "scale (the files come from different saves?)")
    return ""
