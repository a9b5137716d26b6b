"""Save a finalized model with its N:M layout: a directory that loads back as deployed.

:func:`save_pretrained` writes what ``model.save_pretrained`` writes (or ``model.pt`` for a model that is
not a Hugging Face one), the layout record ``nmcompile.json`` (also in each safetensors file's metadata),
and ``model_packed.pt``, the state dict with every 2:4 weight packed (:func:`nmcompile.deploy.pack_state_dict`,
GPT-2's ``Conv1D`` weights as their transpose), when every N:M weight can be packed; for the 2:4 weights on
recorded int8 or 4-bit grids (a one-shot solve with ``bits=8`` or ``4``, or unpacked from such values),
``model_int8.safetensors`` / ``model_int4.safetensors`` with their codes, positions and scales
(:mod:`nmcompile.checkpoint.quantized_weights`). Everything is written
into a temporary folder beside the target and moved into place at the end, so an interrupted save leaves
the target as it was (a new directory is renamed whole; into an existing one the files are moved one by one).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import warnings

import torch
from torch import nn

from ..kernels.format24 import pack_state_dict
from ..kernels.cpu24.weight import PackedLinearWeight
from ..pattern import NMPattern
from ..state import memory
from ..state.records import root
from . import conversions, folders
from .quantized_weights import grids_of, write_codes
from .layout import METADATA_KEY, OWN_FILES, PACKED_FILE, RECORD_FILE, Layout, layout_of, write_layout
from .weight_files import stamp_safetensors, tensor_sources, weight_files

__all__ = ["save_pretrained", "check_disk", "weight_file", "PACKED_FILE"]

#: files of an earlier save that a new save into the same directory replaces or removes
WEIGHT_FILES = (*OWN_FILES, "model.safetensors.index.json", RECORD_FILE)


#: the packed file is written only when its packed weights, all held at once by ``torch.save``, take at
#: most this fraction of the memory available
PACKED_MEMORY_FRACTION = 0.5


def _packed_bytes(model: nn.Module, layout: Layout) -> int:
    """The bytes of the packed weights: half the values plus one 16-bit metadata word per 16."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return sum(int(params[name].numel()) * params[name].element_size() // 2 + int(params[name].numel()) // 8
               for name in layout.weights if name in params)


def _why_not_packed(model: nn.Module, layout: Layout, staging: str) -> str | None:
    """Why the packed file cannot hold every N:M weight packed, or None."""

    for name, entry in layout.weights.items():
        if entry.pattern != NMPattern(2, 4):
            return f"{name} is {entry.pattern}, and the packed format holds 2:4"
        if len(entry.shape) != 2 or entry.dim not in (0, 1, -1, -2):
            return f"{name} is a {len(entry.shape)}-D weight grouped along dim {entry.dim} (packed: 2-D weights)"
        if entry.shape[entry.dim] % 16:
            return f"{name}'s reduction dim ({entry.shape[entry.dim]}) is not a multiple of 16"
    need, have = _packed_bytes(model, layout), memory.available_bytes()
    load = ("load the directory packed with nmcompile.deploy.load_pretrained(DIR, packed=True), which packs the "
            "safetensors weights as it reads them")
    if need > PACKED_MEMORY_FRACTION * have:
        return (f"its {need / 1e9:.1f} GB of packed weights, held at once while it is written, are more than half of "
                f"the {have / 1e9:.1f} GB of memory available; {load}")
    stamp = max((os.path.getsize(os.path.join(staging, name)) for name in os.listdir(staging)
                 if name.endswith(".safetensors")), default=0)  # the largest file, written again by stamping
    free = _free_bytes(staging)
    if need + stamp > free:
        return (f"its {need / 1e9:.1f} GB of packed weights do not fit in the {free / 1e9:.1f} GB of disk left"
                + (f" ({stamp / 1e9:.1f} GB of it kept for adding the N:M layout to the safetensors files)" if stamp else "")
                + f"; {load}")
    return None


#: the largest safetensors file a Hugging Face save writes unless ``max_shard_size`` says otherwise:
#: adding the layout to a file's metadata writes that file again beside itself, so a save needs the
#: weights' bytes plus its largest file's free on disk (one 16 GB file would need 32 GB)
SHARD_SIZE = "5GB"


def _state_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s state dict, a tensor shared by several names (tied weights) counted once."""
    seen, total = set(), 0
    for t in model.state_dict(keep_vars=True).values():
        if isinstance(t, torch.Tensor) and not t.is_meta:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _size_bytes(size) -> int | None:
    """``max_shard_size`` in bytes (an int, or "5GB", "500MB", ...: decimal units, as Hugging Face reads
    them); None when it is neither."""
    if isinstance(size, int):
        return size
    units = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([TGMK]B)\s*", str(size).upper())
    return int(float(match[1]) * units[match[2]]) if match else None


def _stamp_bytes(model: nn.Module, hf: bool, shard_size=SHARD_SIZE) -> int:
    """The spare disk that stamping the layout into a save's largest safetensors file takes (0 for model.pt):
    a file holds up to ``shard_size`` (the ``max_shard_size`` of the save), or one tensor larger than that."""
    if not hf:
        return 0
    state, shard = _state_bytes(model), _size_bytes(shard_size)
    largest = max((t.numel() * t.element_size() for t in model.state_dict().values()
                   if isinstance(t, torch.Tensor) and not t.is_meta), default=0)
    return state if shard is None else min(state, max(shard, largest))


def _free_bytes(directory: str) -> int:
    """Free disk bytes where ``directory`` is (or would be made)."""
    folder = os.path.abspath(directory)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    return shutil.disk_usage(folder).free


def check_disk(model: nn.Module, directory, hf: bool = True, what: str = "nmcompile.deploy.save_pretrained",
               shard_size=SHARD_SIZE) -> None:
    """Raise ``OSError`` when the disk at ``directory`` cannot take a save of ``model``: its weights, plus
    (``hf``) its largest safetensors file again, of at most ``shard_size`` (the save's ``max_shard_size``;
    see :data:`SHARD_SIZE`). The packed file is not counted: a save skips it, with a warning and the
    reason recorded, when the disk cannot take it."""
    weights, stamp = _state_bytes(model), _stamp_bytes(model, hf, shard_size)
    need, free = weights + stamp, _free_bytes(os.fspath(directory))
    if need > free:
        again = (f", plus one file of up to {stamp / 1e9:.1f} GB written again to add the N:M layout to its metadata"
                 if stamp else "")
        raise OSError(f"{what}: saving the model to {os.path.abspath(os.fspath(directory))} needs about "
                      f"{need / 1e9:.1f} GB of disk ({weights / 1e9:.1f} GB of weights{again}), and that disk has "
                      f"{free / 1e9:.1f} GB free; free some space or write elsewhere")


def _write_packed(model: nn.Module, layout: Layout, path: str) -> None:
    state = model.state_dict()
    torch.save(pack_state_dict(state, names=list(layout.weights),
                               dims={name: entry.dim for name, entry in layout.weights.items()}), path)


def save_pretrained(model: nn.Module, directory, *, tokenizer=None, packed: bool = True, hf: bool | None = None,
                    **save_kwargs) -> list[str]:
    """Write a finalized ``model`` and its N:M layout into ``directory``; the paths written.

    Args:
        model: a model finalized with :func:`nmcompile.finalize` (dense weights: unpack a packed-only
            model with :func:`nmcompile.deploy.unpack_weights` first).
        directory: the output folder (made if missing; a symbolic link is written through). Into an
            existing folder, the files written replace theirs, and the weights files of an earlier save that
            this one does not write (``model*.safetensors``, its index, ``pytorch_model*.bin``, ``model.pt``,
            ``model_packed.pt``, ``nmcompile.json``) are removed; other files stay. The folder changes whole
            or not at all (:mod:`nmcompile.checkpoint.folders`): an error leaves it as it was.
        tokenizer: written beside the model (its ``save_pretrained``), e.g. for ``nmcompile prune``.
        packed: also write ``model_packed.pt`` with the 2:4 weights packed. It is written only when every
            N:M weight can be packed (2:4, 2-D, reduction dim a multiple of 16), the packed weights, held
            at once while the file is written, take at most half the memory available, and the disk has
            room for them; otherwise a warning says why, and so does the record.
        hf: write a Hugging Face directory (``model.save_pretrained``, safetensors) rather than ``model.pt``
            (``torch.save`` of the whole model); default: whether ``model`` has ``save_pretrained``.
        save_kwargs: passed to ``model.save_pretrained`` (e.g. ``max_shard_size``, here by default
            :data:`SHARD_SIZE`, "5GB").

    Raises ``OSError`` before writing anything when the folder cannot be written, or when the disk cannot
    take the weights plus their largest file again (:func:`check_disk`).

    Load it back with :func:`nmcompile.deploy.load_pretrained` (``packed=True``: straight into packed
    weights), or with ``from_pretrained`` followed by :func:`nmcompile.deploy.restore`.
    """
    model = root(model)
    layout = layout_of(model)
    held = [name for name, p in model.named_parameters() if isinstance(p, PackedLinearWeight)]
    if held:
        raise ValueError(f"nmcompile.deploy.save_pretrained: {', '.join(held[:5])} "
                         f"{'is' if len(held) == 1 else 'are'} held packed only; call nmcompile.deploy.unpack_weights"
                         "(model) first (or save the packed state dict with nmcompile.deploy.pack_state_dict)")
    hf = hasattr(model, "save_pretrained") if hf is None else hf
    if hf and not hasattr(model, "save_pretrained"):
        raise ValueError(f"save_pretrained(hf=True): {type(model).__name__} is not a Hugging Face model (it has no "
                         "save_pretrained); pass hf=False to write model.pt")
    what = "nmcompile.deploy.save_pretrained"
    directory = folders.resolve(directory, what)
    if hf:
        save_kwargs.setdefault("max_shard_size", SHARD_SIZE)
    folders.check_writable(directory, what)
    check_disk(model, directory, hf, shard_size=save_kwargs.get("max_shard_size"))
    folders.clean_stale(directory, what)
    staging = folders.staging(directory)
    try:
        grids = grids_of(model, layout) if hf else {}  # first: a grid that cannot be saved stops it before writing
        if hf:
            model.save_pretrained(staging, safe_serialization=True, **save_kwargs)
            layout.saved = _saved_names(model, layout, staging)
        else:
            torch.save(model, os.path.join(staging, "model.pt"))
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if grids:  # weights on recorded grids: their codes beside the dense files (which hold code times scale)
            write_codes(model, layout, grids, staging)
        why = _why_not_packed(model, layout, staging) if packed else None
        if packed and why is None:
            _write_packed(model, layout, os.path.join(staging, PACKED_FILE))
            layout.packed = {"file": PACKED_FILE}
        elif packed:
            layout.packed = {"file": None, "why": why}
            warnings.warn(f"nmcompile.deploy.save_pretrained: {PACKED_FILE} was not written: {why}", stacklevel=2)
        write_layout(staging, layout)
        _stamp(staging, layout)
        written = sorted(os.listdir(staging))
        # an earlier save's weights files that this one does not write go; every other file stays
        folders.replace_folder(staging, directory, lambda name: not weight_file(name), what)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [os.path.join(directory, name) for name in written]


def _saved_names(model: nn.Module, layout: Layout, staging: str) -> dict[str, list[str]]:
    """``{name: file tensors}`` of the recorded weights that transformers wrote under other names than the
    model's (a Mixtral's fused experts: one Linear weight per expert; :mod:`nmcompile.checkpoint.conversions`).
    A recorded N:M weight that the files hold under no name nmcompile can map back is a ValueError."""
    files = weight_files(staging, required=False)
    sources = tensor_sources(files) if files else {}
    wanted = {name for name in (*layout.weights, *layout.dense) if name not in sources}
    if not wanted or not sources:
        return {}
    saved, problems = {}, []
    for group in conversions.groups(model, {key: (s.shape(key), s.dtype(key)) for key, s in sources.items()}):
        problems += [group.problem] if group.problem else []
        for name in group.targets:
            if name in wanted:
                saved[name] = list(group.sources)
    lost = [name for name in layout.weights if name not in sources and name not in saved]
    if lost:
        raise ValueError(
            f"nmcompile.deploy.save_pretrained: {type(model).__name__}.save_pretrained wrote the N:M weights "
            f"{', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''} under names that nmcompile cannot map back to the "
            "model's (transformers' conversions of this model's checkpoints" + "".join(f"; {p}" for p in problems[:2])
            + "), so the directory could be neither checked nor loaded packed; pass save_original_format=False to "
            "write the weights under the model's own names")
    return saved


def _stamp(folder: str, layout: Layout) -> None:
    """The layout record into the metadata of each safetensors file in ``folder``."""
    text = json.dumps(layout.to_json(), separators=(",", ":"))
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            stamp_safetensors(os.path.join(folder, name), {METADATA_KEY: text})


def weight_file(name: str) -> bool:
    """Whether ``name`` is a weights file (or record) of a save, which a new save replaces or removes."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in WEIGHT_FILES)
