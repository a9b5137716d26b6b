"""The record of a deployed model's N:M layout, written next to its weights: which weight is N:M along which dim.

A finalized model knows its layout (a :class:`~nmcompile.state.deployed.Deployed` record in each owning
module), but a weights file does not: loaded back, it is a dense model, and a compliance check of the file
cannot tell a GPT-2 ``Conv1D`` weight (2:4 along dim 0) from a ``Linear`` one (along dim 1).
:class:`Layout` is that knowledge as data. :func:`nmcompile.deploy.save_pretrained` and ``nmcompile prune``
write it as ``nmcompile.json`` in the model's directory (and into each safetensors file's metadata, under
``"nmcompile"``); :func:`nmcompile.deploy.restore`, :func:`nmcompile.deploy.load_pretrained` and
``nmcompile check DIR`` read it. The file::

    {"format": "nmcompile-layout", "version": 1, "nmcompile": "0.1.0",
     "weights": {"transformer.h.0.attn.c_attn.weight": {"pattern": "2:4", "dim": 0, "shape": [768, 2304],
                                                          "recipe": "sparsegpt:2:4"}, ...},
     "tied": {"lm_head.weight": "transformer.wte.weight"},
     "dense": {"transformer.wte.weight": "embedding weight (transformer.wte), tied to lm_head.weight; ..."},
     "packed": {"file": "model_packed.pt"}}

``weights`` names each N:M weight by its state-dict name, with its pattern, grouping dim and shape;
``tied`` maps each other name of a shared weight to the name the record and the weights files use;
``dense`` names the other >= 2-D weights with why they are dense; ``packed`` names the packed 2:4 file
(:func:`nmcompile.deploy.pack_state_dict`), or says why none was written (``{"file": null, "why": ...}``).
A weight whose kept values are int8 codes carries ``"bits": 8``, and ``int8`` names the file that holds the
codes, positions and scales (:mod:`nmcompile.checkpoint.quantized_weights`): ``"int8": {"file":
"model_int8.safetensors"}``; one of 4-bit codes ``"bits": 4``, in the file ``int4`` names. ``saved`` (only where there are such weights) names the file tensors of each
weight that transformers writes under other names than the model holds it (:mod:`nmcompile.checkpoint.conversions`), e.g. a Mixtral's fused
experts, written one ``Linear`` weight per expert::

    "saved": {"model.layers.0.mlp.experts.down_proj": ["model.layers.0.block_sparse_moe.experts.0.w2.weight", ...]}
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from dataclasses import dataclass, field

from torch import nn

from ..pattern import NMPattern
from ..state.records import deployed_of, owners
from ..version import __version__
from ..declare.annotate import skip_reason
from .weight_files import safetensors_metadata
from .weight_files import weight_files

__all__ = ["Layout", "LayoutWeight", "layout_of", "read_layout", "write_layout", "RECORD_FILE", "METADATA_KEY",
           "OWN_FILES", "PACKED_FILE", "INT8_FILE", "INT4_FILE"]

RECORD_FILE = "nmcompile.json"
#: the state dict with every 2:4 weight packed, beside the weights files (written where they all pack)
PACKED_FILE = "model_packed.pt"
#: the codes, positions and scales of the weights with int8 values (:mod:`nmcompile.checkpoint.quantized_weights`)
INT8_FILE = "model_int8.safetensors"
#: the same for weights with 4-bit values
INT4_FILE = "model_int4.safetensors"
#: the key of the record in a safetensors file's metadata (a JSON string)
METADATA_KEY = "nmcompile"
FORMAT, VERSION = "nmcompile-layout", 1
#: the weights files of a saved directory, which its record describes (a file of another name beside it may not)
OWN_FILES = ("model.safetensors", "model-*-of-*.safetensors", "pytorch_model*.bin", "model.pt", PACKED_FILE, INT8_FILE,
             INT4_FILE)


@dataclass(frozen=True)
class LayoutWeight:
    """One N:M weight of a deployed model."""

    pattern: NMPattern
    dim: int  # grouping (reduction) dim: 1 for Linear, 0 for GPT-2's Conv1D
    shape: tuple[int, ...]
    recipe: str = ""
    bits: int | None = None  # 8 or 4: values in that width's codes file (:mod:`nmcompile.checkpoint.quantized_weights`)

    def with_bits(self, bits: int | None) -> LayoutWeight:
        return dataclasses.replace(self, bits=bits)


@dataclass
class Layout:
    """The N:M layout of a deployed model (see the module doc for the file)."""

    weights: dict[str, LayoutWeight] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)  # other name -> the name weights files hold it under
    dense: dict[str, str] = field(default_factory=dict)  # name -> why it is dense
    packed: dict | None = None  # {"file": name} or {"file": None, "why": ...}; None: not said
    saved: dict[str, list[str]] = field(default_factory=dict)  # name -> the file tensors transformers wrote it as
    int8: dict | None = None  # {"file": name}: the int8 codes of the weights with bits 8
    int4: dict | None = None  # {"file": name}: the 4-bit codes of the weights with bits 4
    nmcompile: str = __version__  # the version that wrote it

    def canonical(self, name: str) -> str:
        """The name the record and the weights files use for ``name`` (itself unless it is a tied alias)."""
        return self.tied.get(name, name)

    def to_json(self) -> dict:
        out = {
            "format": FORMAT, "version": VERSION, "nmcompile": self.nmcompile,
            "weights": {name: {"pattern": str(w.pattern), "dim": w.dim, "shape": list(w.shape),
                               **({"recipe": w.recipe} if w.recipe else {}), **({"bits": w.bits} if w.bits else {})}
                        for name, w in self.weights.items()},
            "tied": dict(self.tied),
            "dense": dict(self.dense),
        }
        if self.packed is not None:
            out["packed"] = dict(self.packed)
        if self.saved:
            out["saved"] = {name: list(files) for name, files in self.saved.items()}
        for key in ("int8", "int4"):
            if getattr(self, key) is not None:
                out[key] = dict(getattr(self, key))
        return out

    def saved_as(self) -> dict[str, str]:
        """``{file tensor name: the model's name of the weight it is (part of)}`` for the weights in ``saved``."""
        return {part: name for name, parts in self.saved.items() for part in parts}

    @classmethod
    def from_json(cls, data, where: str) -> Layout:
        """The layout in ``data`` (parsed JSON); ``where`` names its source in errors (ValueError)."""

        def bad(what: str) -> ValueError:
            return ValueError(f"{where}: not an nmcompile layout record ({what}); it is written by "
                              "nmcompile.deploy.save_pretrained and nmcompile prune")

        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise bad(f"its 'format' is not {FORMAT!r}")
        if not isinstance(data.get("version"), int) or data["version"] > VERSION:
            raise ValueError(f"{where}: layout record version {data.get('version')!r}, written by nmcompile "
                             f"{data.get('nmcompile', '?')}; this nmcompile ({__version__}) reads versions up to "
                             f"{VERSION}: upgrade nmcompile")
        weights = data.get("weights")
        if not isinstance(weights, dict):
            raise bad("'weights' is not a mapping")
        layout = cls(nmcompile=str(data.get("nmcompile", "")))
        for name, entry in weights.items():
            try:
                bits = entry.get("bits")
                if bits not in (None, 8, 4):
                    raise ValueError(f"bits {bits!r} (this nmcompile reads 8 and 4)")
                layout.weights[name] = LayoutWeight(NMPattern.of(entry["pattern"]), int(entry["dim"]),
                                                    tuple(int(s) for s in entry["shape"]), str(entry.get("recipe", "")),
                                                    bits)
            except (KeyError, TypeError, ValueError) as err:
                raise bad(f"the entry of {name!r} is {entry!r}: {err}") from None
        for key in ("tied", "dense"):
            value = data.get(key, {})
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise bad(f"{key!r} is not a mapping of names to strings")
            setattr(layout, key, dict(value))
        if isinstance(data.get("packed"), dict):
            layout.packed = dict(data["packed"])
        for key in ("int8", "int4"):
            if isinstance(data.get(key), dict):
                setattr(layout, key, dict(data[key]))
        saved = data.get("saved", {})
        if not isinstance(saved, dict) or not all(isinstance(v, list) and all(isinstance(f, str) for f in v)
                                                  for v in saved.values()):
            raise bad("'saved' is not a mapping of names to lists of names")
        layout.saved = {name: list(files) for name, files in saved.items()}
        return layout


def layout_of(model: nn.Module) -> Layout:
    """The layout of a finalized ``model``, from the deploy records of its modules (ValueError if none)."""
    layout = Layout()
    patterns = []
    for name, places in owners(model):
        _, module, pname = places[0]
        for mname, _, other in places[1:]:
            layout.tied[f"{mname}.{other}" if mname else other] = name
        record = deployed_of(module, pname)
        param = module._parameters[pname]
        if record is not None:
            layout.weights[name] = LayoutWeight(record.pattern, record.dim, tuple(param.shape), record.recipe)
            patterns.append(record.pattern)
    if not layout.weights:
        raise ValueError(
            f"{type(model).__name__} has no finalized N:M weight, so there is no layout to record: call "
            "nmcompile.finalize(model) (or finalize(model, pattern='2:4') for a loaded N:M checkpoint) first"
        )
    pattern = max(set(patterns), key=patterns.count)
    for name, places in owners(model):
        param = places[0][1]._parameters[places[0][2]]
        if name not in layout.weights and param.dim() >= 2:
            why, _ = skip_reason(places, pattern)
            layout.dense[name] = why or f"not declared or finalized {pattern}"
    return layout


def write_layout(directory, layout: Layout) -> str:
    """Write ``layout`` as ``directory/nmcompile.json``; its path."""
    path = os.path.join(os.fspath(directory), RECORD_FILE)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(layout.to_json(), handle, indent=1)
        handle.write("\n")
    return path


def _from_safetensors(path: str) -> Layout | None:
    text = safetensors_metadata(path).get(METADATA_KEY)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: the '{METADATA_KEY}' entry of its metadata is not JSON ({err})") from None
    return Layout.from_json(data, f"{path} (metadata '{METADATA_KEY}')")


def read_layout(path) -> Layout | None:
    """The layout recorded for ``path``, or None when there is none.

    ``path``: a model directory (its ``nmcompile.json``, else the metadata of its safetensors file), or
    one of its weights files (:data:`OWN_FILES`: the ``nmcompile.json`` beside it), or a safetensors file
    (its own metadata). A record that cannot be read is a ValueError that names the file.
    """
    path = os.fspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    record = os.path.join(directory, RECORD_FILE)
    own = os.path.isdir(path) or any(fnmatch.fnmatchcase(os.path.basename(path), p) for p in OWN_FILES)
    if own and os.path.isfile(record):
        try:
            with open(record, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{record}: not a readable JSON layout record ({err}); write it again with "
                             "nmcompile.deploy.save_pretrained") from None
        return Layout.from_json(data, record)
    if os.path.isdir(path):
        files = weight_files(path, required=False)
        return _from_safetensors(files[0]) if files and files[0].endswith(".safetensors") else None
    return _from_safetensors(path) if path.endswith(".safetensors") else None
