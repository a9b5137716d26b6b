"""Load a deployed Hugging Face directory as deployed: records set, or straight into packed 2:4 weights.

:func:`load_pretrained` reads a directory written by :func:`nmcompile.deploy.save_pretrained` or
``nmcompile prune`` (no network). Dense, it is ``from_pretrained`` plus :func:`nmcompile.deploy.restore`.
Packed (``packed=True``), the model is built on the meta device (by contexts that only the loading thread
sees: loads and model builds in other threads are unaffected), the buffers computed from the config are made
by the model's own initialization, and each weight is read from ``model_packed.pt`` where the folder holds it (its
2:4 entries need no packing), else from the safetensors files a run of rows at a time (:mod:`nmcompile.checkpoint.streaming`): the N:M ones
straight into packed 2:4 CPU weights (checked on the way in), the others dense. No dense copy of the
model, nor of any packed weight, is ever resident: the load peaks at the packed model plus one chunk.
The weights that transformers writes under other names or shapes (a Mixtral's fused experts, one Linear weight
per expert: :mod:`nmcompile.checkpoint.conversions`) are built from their file tensors as ``from_pretrained``
builds them, checked, and packed where the kernel takes them; fused experts, 3-D, are held dense (warned).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from .. import masks
from ..kernels import cpu24
from ..kernels.cpu24.weight import PackedLinearWeight
from ..pattern import NMPattern
from ..state import records
from ..state.deployed import Deployed
from ..state.records import DEPLOYED, owners
from . import conversions
from .layout import Layout
from .quantized_weights import WIDTHS, codes_files, record_grids
from .packed_weights import INT4_REASON, INT8_REASON, RangeRule, _head_of, _pack_head, is_trainable, set_packed
from .restore import layout_from, restore
from .streaming import PackedStateFile, build_on_meta, chunk_budget, packable, read_dense, read_packed
from .weight_files import tensor_sources, weight_files

__all__ = ["load_pretrained"]


def _compute_buffers(model: nn.Module, sources: dict) -> None:
    """Make real the buffers that the construction left on the meta device and the files do not hold (those
    computed from the config, not saved: rotary frequencies), computed by the model's own initialization
    (``_init_weights`` of the transformers model that holds them), as ``from_pretrained`` computes them. The
    parameters are still on the meta device, where initializing them costs nothing. A buffer that the
    initialization does not write stays on the meta device, and the load names it."""
    transformers = _transformers()

    def visit(module: nn.Module, prefix: str, init) -> None:
        if isinstance(module, transformers.PreTrainedModel):
            init = module._init_weights
        made = {name: torch.empty_like(buffer, device="cpu") for name, buffer in module._buffers.items()
                if buffer is not None and buffer.is_meta and prefix + name not in sources}
        if made and init is not None:
            meta = {name: module._buffers[name] for name in made}
            versions = {name: tensor._version for name, tensor in made.items()}
            module._buffers.update(made)
            with torch.no_grad():
                init(module)
            for name, tensor in made.items():
                if module._buffers[name] is tensor and tensor._version == versions[name]:
                    module._buffers[name] = meta[name]  # not computed: named by the load, never left garbage
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.", init)

    visit(model, "", None)


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("nmcompile.deploy.load_pretrained reads Hugging Face directories, which needs transformers "
                          "(pip install transformers)") from err
    return transformers


def _model_class(config, model_class):
    if model_class is not None:
        return model_class
    transformers = _transformers()
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def load_pretrained(path, *, packed: bool = False, dtype: torch.dtype | None = None, model_class=None,
                    measure: bool = True, head: str | None = "auto", activations: str | None = None) -> nn.Module:
    """The model a deployed directory holds, with its N:M weights recorded as deployed (eval mode).

    Args:
        path: a local Hugging Face directory written by :func:`nmcompile.deploy.save_pretrained` or
            ``nmcompile prune`` (it holds ``nmcompile.json``, the layout record); nothing is downloaded.
        packed: hold the 2:4 weights packed only on the CPU
            (:class:`~nmcompile.kernels.cpu24.weight.PackedLinearWeight`, run by the 2:4 CPU kernel),
            loaded without a dense copy ever resident: the load peaks at about the packed model's bytes. Read
            from ``model_packed.pt`` where the folder holds it (a folder shipped for CPU serving needs no
            safetensors file), else from the safetensors files. Recorded weights the kernel cannot hold (another pattern, a reduction dim not a multiple of 16)
            are loaded dense, with a warning naming them.
        dtype: the floating dtype of the weights (default: as stored).
        model_class: the ``transformers`` model class (default: the config's ``architectures``, else
            ``AutoModelForCausalLM``).
        measure: with ``packed``, time the kernel on each weight shape against unpacking it for a dense
            GEMM and keep it for the token counts where it won, as :func:`nmcompile.deploy.pack_weights`
            does (decisions are cached on disk: a second process reads them instead of timing; a shape
            timed here holds at most 64 MB of scratch copies while it is timed); without it the kernel
            takes every token count.
        head: for a directory whose 2:4 weights hold int8 or 4-bit values (``"bits": 8`` or ``4`` in its
            record), loaded ``packed``: the output head held as dense rows of that width (4-bit in groups of 64),
            as ``pack_weights(model, bits=..., head=...)`` holds it (``"auto"``: ``get_output_embeddings()``; a module name; None keeps it as stored). A
            module name for any other directory, or with ``packed=False``, is refused (ValueError).
        activations: with ``packed``, what the int8 weights' products take their activations as: ``"float"`` or
            ``"int8"`` (quantized in blocks of 32, integer products), as ``pack_weights(model, activations=...)``
            says (None: ``"int8"`` for a directory with 4-bit values, which run with no other, else ``"float"``);
            ``"int8"`` for a directory without int8 or 4-bit values, or loaded dense, is refused (ValueError).

    A directory with int8 or 4-bit values (a ``bits=8`` or ``bits=4`` one-shot solve, or a model unpacked from
    such values) loads ``packed`` straight from its codes files (codes, positions, scales); dense, each such
    weight is its dequantized value with its grid recorded, so ``pack_weights(model)`` holds it on that grid
    again.

    Then ``nmcompile.check(model)`` passes and ``torch.compile(model, backend="nmsparse")`` deploys it.

    Raises:
        ValueError: the directory has no layout record, or a recorded weight is not N:M along its
            recorded dim, or is missing (each named).
        RuntimeError: ``packed=True`` where the 2:4 CPU kernel cannot run (the reason is given).
    """
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        pickled = os.path.join(path, "model.pt")
        raise ValueError(f"load_pretrained: {path} has no config.json, so it is not a Hugging Face model directory"
                         + (f"; {pickled} is a whole pickled model, whose deploy records travel with it: "
                            "torch.load(path, weights_only=False), for files you trust" if os.path.isfile(pickled) else ""))
    layout, _ = layout_from(path)
    widths = {w.bits for w in layout.weights.values() if w.bits}
    isa8 = _check_options(path, packed, widths, head, activations)
    transformers = _transformers()
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    cls = _model_class(config, model_class)
    if not packed:
        if not weight_files(path, required=False) and _packed_file(path, layout):
            raise ValueError(f"load_pretrained: {path} holds its weights only in {_packed_file(path, layout)} (2:4 "
                             "weights packed): load it with packed=True (the 2:4 CPU kernel), or ship "
                             "model.safetensors beside it for a dense load")
        model = cls.from_pretrained(path, local_files_only=True, dtype=dtype or "auto")
        restore(model, layout)
        record_grids(model, layout, path)
        return model.eval()
    state = cpu24.status()
    if not state.available:
        raise RuntimeError(f"load_pretrained(packed=True) needs the 2:4 CPU kernel, which is not available here: "
                           f"{state.reason}; load with packed=False")
    sources = _sources(path, layout)
    if dtype is None:  # build in the stored dtype, as from_pretrained(dtype="auto") does
        stored = [s.dtype(k) for k, s in sources.items() if s.dtype(k).is_floating_point]
        dtype_built = max(set(stored), key=stored.count) if stored else torch.get_default_dtype()
    else:
        dtype_built = dtype
    model = build_on_meta(cls, config, dtype_built)
    _compute_buffers(model, sources)
    _stream(model, layout, sources, dtype, measure, path, isa8)
    found = _head_of(model, head) if widths else None
    if found is not None:
        _pack_head(model, *found, isa8, min(widths))
    generation = os.path.join(path, "generation_config.json")
    if os.path.isfile(generation) and getattr(model, "generation_config", None) is not None:
        model.generation_config = transformers.GenerationConfig.from_pretrained(path, local_files_only=True)
    return model.eval()


def _check_options(path: str, packed: bool, widths: set, head, activations) -> str | None:
    """The ISA of the directory's int8 or 4-bit weights held packed (None: none such, or loaded dense); ValueError
    for ``head`` or ``activations`` that do not apply."""
    what = (f"{path} is loaded {'packed' if packed else 'dense'} and its weights hold "
            f"{' and '.join(WIDTHS[b] for b in sorted(widths, reverse=True)) or 'float'} values")
    if head not in ("auto", None) and not (packed and widths):
        raise ValueError(f"load_pretrained: head={head!r} holds the output head as int8 or 4-bit rows, which applies "
                         f"only to a directory whose 2:4 weights hold such values, loaded packed=True; {what}. Drop "
                         "head=, or after loading call nmcompile.deploy.pack_weights(model, bits=8, head=...)")
    if 4 in widths and packed and activations not in (None, "int8"):
        raise ValueError(f"load_pretrained: activations={activations!r}: {what}, and 4-bit values run with int8 "
                         "activations only; drop activations= (or load dense and pack_weights(model, bits=8))")
    activations = activations or ("int8" if 4 in widths and packed else "float")
    isa8 = cpu24.int8_isa(activations) if packed and widths else None
    if activations != "float" and isa8 is None:
        raise ValueError(f"load_pretrained: activations={activations!r} is the route of int8 weights held packed; "
                         f"{what}. Drop activations=")
    return isa8


def _packed_file(path: str, layout: Layout) -> str | None:
    name = (layout.packed or {}).get("file")
    return os.path.join(path, name) if name and os.path.isfile(os.path.join(path, name)) else None


def _sources(path: str, layout: Layout) -> dict:
    """``{tensor name: source}``: the packed state dict the record names (its 2:4 weights need no packing: half
    the load time of a 1B model), else the safetensors files."""
    packed_file = _packed_file(path, layout)
    if packed_file is None:
        return tensor_sources(weight_files(path))  # raises, naming what a directory must hold
    source = PackedStateFile(packed_file)
    return {key: source for key in source.keys()}


def _stream(model: nn.Module, layout: Layout, sources: dict, dtype: torch.dtype | None, measure: bool,
            directory: str, isa8: str | None) -> None:
    """Fill the meta parameters of ``model`` from ``sources``, the recorded 2:4 weights packed (those with int8 or
    4-bit values from the directory's codes files, run on ``isa8``)."""
    plan, missing, loaded, known = [], [], set(), set()
    for name, places in owners(model):
        names = [f"{m}.{p}" if m else p for m, _, p in places]
        known.update(names)
        key = next((n for n in names if n in sources), None)
        if key is None:
            missing.append((name, names, places))
        else:
            plan.append((key, names, places))
            loaded.update(names)
    converted = []
    if missing:  # held by the files under other names or shapes (transformers' conversions: fused experts)
        converted, missing = _converted(model, sources, missing, plan, loaded)
    unknown = [n for n in layout.weights if n not in known]
    if missing or unknown:  # said before anything is read
        raise ValueError(
            "nmcompile.deploy.load_pretrained: "
            + (f"parameters of {type(model).__name__} that no weights file holds: "
               f"{', '.join(name for name, _, _ in missing[:10])}; " if missing else "")
            + (f"the layout record names weights the model does not have: {', '.join(unknown[:10])}; " if unknown else "")
            + "the directory was written for another model, or is incomplete"
        )
    files = codes_files(directory, layout)
    sparse = sum(sources[k].shape(k)[0] * sources[k].shape(k)[1] for k in layout.weights
                 if k in sources and len(sources[k].shape(k)) == 2)
    budget = chunk_budget(sparse)
    dense_recorded = []
    for key, names, places in plan:
        source = sources[key]
        entry = next((layout.weights[n] for n in names if n in layout.weights), None)
        if entry is None:
            tensor = read_dense(source, key, dtype, budget)
            _place(tensor, places, tensor.is_floating_point())
            continue
        if tuple(source.shape(key)) != tuple(entry.shape):
            _not_recorded(f"{key} is {list(source.shape(key))} in {source.path}, the record says {list(entry.shape)}")
        why = None if entry.pattern == NMPattern(2, 4) else f"{entry.pattern} is not 2:4"
        why = why or packable(source.shape(key), entry.dim, dtype or source.dtype(key))
        record = Deployed(entry.pattern, entry.dim, entry.recipe)
        if why is None and entry.bits:  # its codes, positions and scales: the dense copy is not read
            name = next(n for n in names if n in layout.weights)
            weight = files[entry.bits].packed(name, dtype or source.dtype(key), isa8)
            _hold_packed(weight, places, measure, f"{INT4_REASON if weight.int4 else INT8_REASON}; loaded")
            scales = files[entry.bits].scales(name)
            for _, module, pname in places:
                records.put(module, records.INT4 if weight.int4 else records.INT8, pname, scales)
        elif why is None:
            weight = source.packed(key, dtype) if isinstance(source, PackedStateFile) else None
            if weight is None:
                weight, bad, total = read_packed(source, key, dtype, entry.dim in (0, -2), budget)
                if bad:
                    _not_recorded(f"{key} in {source.path}: {bad}/{total} groups along dim {entry.dim} keep more "
                                  "than 2 of 4")
            _hold_packed(weight, places, measure, "packed only, loaded")
        else:
            tensor = read_dense(source, key, dtype, budget)
            bad, total = _violations(tensor, entry)
            if bad:
                _not_recorded(f"{key} in {source.path}: {bad}/{total} groups along dim {entry.dim} are not "
                              f"{entry.pattern}")
            _place(tensor, places, False)
            dense_recorded.append(f"{key} ({why})")
        for _, module, pname in places:
            records.put(module, DEPLOYED, pname, record)
    for group, targets in converted:
        _load_converted(group, targets, layout, sources, dtype, budget, measure, dense_recorded)
    _load_buffers(model, sources, loaded)
    if dense_recorded:
        warnings.warn("nmcompile.deploy.load_pretrained(packed=True): these N:M weights are held dense, the 2:4 CPU "
                      "kernel does not take them: " + ", ".join(dense_recorded), stacklevel=3)


def _hold_packed(weight, places, measure: bool, how_loaded: str) -> None:
    """``weight`` (packed) in the places of the meta parameter it replaces, with its token range."""
    bias = getattr(places[0][1], "bias", None)
    decision = RangeRule(isinstance(bias, torch.Tensor), measure, how_loaded).decide(weight)
    trainable = is_trainable(places[0][1]._parameters[places[0][2]])
    for _, module, pname in places:
        set_packed(module, pname, weight, decision, trainable)


def _converted(model: nn.Module, sources: dict, missing: list, plan: list, loaded: set) -> tuple[list, list]:
    """``(converted, still missing)``: the parameters in ``missing`` (``(name, names, places)``) that the files
    hold under other names or shapes, as transformers' conversions say (:mod:`nmcompile.checkpoint.conversions`).
    A renamed one joins ``plan`` under its file name (read as any other); the others come back as
    ``[(group, [(name, names, places), ...])]``, built from their file tensors when they are loaded."""
    where = {n: item for item in missing for n in item[1]}
    shapes = {key: (source.shape(key), source.dtype(key)) for key, source in sources.items() if key not in loaded}
    converted, found = [], set()
    for group in conversions.groups(model, shapes):
        if group.problem:
            warnings.warn(f"nmcompile.deploy.load_pretrained: {group.problem}; its tensors are left unused",
                          stacklevel=4)
        targets = [where[name] for name in group.targets if name in where and where[name][0] not in found]
        if not targets:
            continue
        found.update(name for name, _, _ in targets)
        loaded.update(group.sources)
        loaded.update(n for _, names, _ in targets for n in names)
        if group.renaming:
            _, names, places = targets[0]
            plan.append((group.sources[0], names, places))
        else:
            converted.append((group, targets))
    return converted, [item for item in missing if item[0] not in found]


def _load_converted(group, targets: list, layout: Layout, sources: dict, dtype, budget: int, measure: bool,
                    dense_recorded: list) -> None:
    """The weights a transformers conversion makes from the file tensors of ``group`` (a Mixtral's fused experts
    from one Linear weight per expert), built dense as ``from_pretrained`` builds them, each recorded one checked
    N:M and packed where the 2:4 CPU kernel takes it (a 2-D weight: one dense weight is resident meanwhile),
    otherwise held dense and named in ``dense_recorded``."""
    made = group.convert(lambda key: read_dense(sources[key], key, dtype, budget))
    parts = f"{', '.join(group.sources[:2])}{' ...' if len(group.sources) > 2 else ''} in {sources[group.sources[0]].path}"
    for name, names, places in targets:
        tensor = made.pop(name)
        entry = next((layout.weights[n] for n in names if n in layout.weights), None)
        if entry is None:
            _place(tensor, places, tensor.is_floating_point())
            continue
        if tuple(tensor.shape) != tuple(entry.shape):
            _not_recorded(f"{name}, built from {parts}, is {list(tensor.shape)}, the record says {list(entry.shape)}")
        bad, total = _violations(tensor, entry)
        if bad:
            _not_recorded(f"{name}, built from {parts}: {bad}/{total} groups along dim {entry.dim} are not {entry.pattern}")
        why = None if entry.pattern == NMPattern(2, 4) else f"{entry.pattern} is not 2:4"
        why = why or packable(tuple(tensor.shape), entry.dim, tensor.dtype)
        if why is None:
            transposed = entry.dim in (0, -2)
            weight = tensor.t() if transposed else tensor
            values, bits, _ = cpu24.cpu_pack(weight)  # checked above: no group keeps more than 2 of 4
            packed = PackedLinearWeight(values, bits, tuple(weight.shape), -1, cpu24.best_isa(values.dtype) or "",
                                        transposed)
            del tensor, weight
            _hold_packed(packed, places, measure, f"packed only, loaded from {len(group.sources)} file tensors")
        else:
            _place(tensor, places, False)
            dense_recorded.append(f"{name} ({why}; written by transformers as {len(group.sources)} file tensors)")
        for _, module, pname in places:
            records.put(module, DEPLOYED, pname, Deployed(entry.pattern, entry.dim, entry.recipe))


def _place(tensor: torch.Tensor, places, trainable: bool) -> None:
    """``tensor`` as the dense parameter in each of ``places``."""
    param = nn.Parameter(tensor, requires_grad=trainable)
    for _, module, pname in places:
        module._parameters[pname] = param


def _not_recorded(problem: str):
    """A weight that is not what the layout record says: the files are not the ones it was written with."""
    raise ValueError(f"nmcompile.deploy.load_pretrained: a weight is not the N:M weight the layout record says it is: "
                     f"{problem}. The weights files and nmcompile.json come from different saves? Save the model again "
                     "with nmcompile.deploy.save_pretrained")


def _violations(tensor: torch.Tensor, entry) -> tuple[int, int]:
    if entry.pattern.fits(tensor, entry.dim) is not None:
        return 1, 1
    return masks.count_violations(tensor, entry.pattern.n, entry.pattern.m, entry.dim)


def _load_buffers(model: nn.Module, sources: dict, loaded: set) -> None:
    """Persistent buffers that the files hold (the others were computed at construction); warn of the
    files' tensors that nothing took."""
    for mname, module in model.named_modules():
        for bname, buffer in list(module._buffers.items()):
            name = f"{mname}.{bname}" if mname else bname
            if buffer is not None and name in sources:
                tensor = sources[name].read(name)
                module._buffers[bname] = tensor.to(buffer.dtype) if buffer.dtype != tensor.dtype else tensor
                loaded.add(name)
    leftover = [k for k in sources if k not in loaded]
    if leftover:
        warnings.warn(f"nmcompile.deploy.load_pretrained: the weights files hold tensors that {type(model).__name__} "
                      f"has no place for, left unused: {', '.join(leftover[:10])}" + (" ..." if len(leftover) > 10 else ""),
                      stacklevel=3)
    still = [f"{m}.{n}" if m else n for m, mod in model.named_modules()
             for n, t in list(mod._parameters.items()) + list(mod._buffers.items()) if t is not None and t.is_meta]
    if still:
        raise ValueError(f"nmcompile.deploy.load_pretrained: {', '.join(still[:10])} of {type(model).__name__} "
                         "were neither in the weights files nor made at construction (still on the meta device)")
