"""ONNX export of finalized models: dense zero-filled N:M initializers, recorded and verified.

The exported file holds each finalized weight as an ordinary dense initializer with its zeros
(what TensorRT's sparsity detection, ``trtexec --sparsity=enable`` or onnxruntime's TensorRT
provider with ``trt_sparsity_enable``, looks at). The model's ``metadata_props`` get
``nmcompile.sparsity``: a JSON object ``{initializer: {"pattern": "2:4", "axis": k, "parameter":
name, "recipe": ...}}``, so :func:`check_onnx` (and ``nmcompile check file.onnx``) can verify the
file later without the model. A weight on a recorded int8 grid is written as int8 codes with a per-channel
``DequantizeLinear``, one on a 4-bit grid as INT4 codes with a blocked one (opset 21; int8 storage in older
opsets) (:mod:`nmcompile.deploy.onnx_quantized`). Requires ``onnx``, ``onnxscript`` and ``onnxruntime``
(``pip install "nmcompile[onnx]"``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..state.records import annotation_of, deployed_of
from ..state.records import owners
from ..masks.compliance import CheckReport, check_one, selects
from ..pattern import NMPattern
from ..kernels.cpu24.weight import PackedLinearWeight
from ..state import records
from .onnx_quantized import BLOCKED_OPSET, codes_matrix, codes_problem, quantize_initializers

__all__ = ["export_onnx", "check_onnx", "OnnxExportReport", "METADATA_KEY"]

METADATA_KEY = "nmcompile.sparsity"
#: a model whose parameters and buffers take more bytes than this is written with its tensors in a
#: ``.onnx.data`` file beside it (a protobuf file holds at most 2 GB); a smaller one keeps them inline
INLINE_BYTES = 1 << 30
TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}


@dataclass
class OnnxExportReport:
    path: str
    initializers: dict[str, dict] = field(default_factory=dict)  # initializer -> its metadata entry
    check: CheckReport | None = None
    max_abs_diff: float | None = None  # onnxruntime vs PyTorch

    def __str__(self) -> str:
        lines = [f"nmcompile.export_onnx: {self.path}: {len(self.initializers)} N:M initializers"]
        if self.check is not None:
            lines.append(str(self.check))
        if self.max_abs_diff is not None:
            lines.append(f"onnxruntime vs PyTorch: max |diff| = {self.max_abs_diff:.3g}")
        return "\n".join(lines)


def _import(name: str):
    try:
        return __import__(name)
    except ImportError as err:
        raise ImportError(f"nmcompile's ONNX export needs {name!r}: pip install \"nmcompile[onnx]\"") from err


def _finalized(model: nn.Module) -> dict[str, object]:
    found, pending = {}, []
    for name, places in owners(model):
        _, module, pname = places[0]
        if deployed_of(module, pname) is not None:
            found[name] = deployed_of(module, pname)
        elif annotation_of(module, pname) is not None:
            pending.append(name)
    if pending:
        raise ValueError(
            f"export_onnx: {', '.join(pending[:3])}{' ...' if len(pending) > 3 else ''} are annotated but not "
            "finalized; call nmcompile.finalize(model) first so the file holds the N:M weights"
        )
    if not found:
        raise ValueError(
            f"export_onnx: no weight of {type(model).__name__} is finalized; annotate, train, then "
            "nmcompile.finalize(model) before exporting (for a finalized checkpoint loaded into a fresh "
            "model: nmcompile.finalize(model, pattern='2:4'))"
        )
    return found


def _find_initializer(proto, numpy_helper, name: str, weight: torch.Tensor):
    """``(initializer name, transposed)`` holding ``weight``: by name, else by content."""
    by_name = {init.name: init for init in proto.graph.initializer}
    if name in by_name:
        return name, False
    target = weight.detach().cpu().float().numpy()
    for init in proto.graph.initializer:
        if tuple(init.dims) == target.shape[::-1] and len(init.dims) == 2:
            if (numpy_helper.to_array(init).astype("float32") == target.T).all():
                return init.name, True
        if tuple(init.dims) == target.shape and (numpy_helper.to_array(init).astype("float32") == target).all():
            return init.name, False
    return None, False


class _DropTorchvisionNotice(logging.Filter):
    """Drops the exporter's "torchvision is not installed. Skipping torchvision::nms" lines (one per
    torchvision op in its registry, logged at every export; nmcompile's models use none of them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("torchvision is not installed")


@contextlib.contextmanager
def _quiet_exporter():
    """PyTorch's exporter's own noise, silenced for one export and restored after it: the torchvision
    lines above and the pytree ``LeafSpec`` deprecation (a FutureWarning from PyTorch's internals)."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    drop = _DropTorchvisionNotice()
    logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
            yield
    finally:
        logger.removeFilter(drop)


def _tensors(args) -> tuple:
    return args if isinstance(args, tuple) else (args,)


def export_onnx(model: nn.Module, args, path, *, dynamic_batch: bool = True, verify: bool = True,
                opset: int | None = None, **export_kwargs) -> OnnxExportReport:
    """Export a finalized model to ONNX, verify every N:M initializer, and compare onnxruntime with PyTorch.

    Args:
        model: a model after :func:`nmcompile.finalize`.
        args: example input tensor or tuple of tensors (batch first when ``dynamic_batch``).
        path: the ``.onnx`` file to write.
        dynamic_batch: make dim 0 of every tensor input dynamic (``batch``).
        verify: run the file with onnxruntime (CPU) and compare with the model's outputs.
        opset: ONNX opset (default: the exporter's; 21 for a model with weights on 4-bit grids, whose blocked
            DequantizeLinear needs it).
        export_kwargs: passed to ``torch.onnx.export``. ``external_data`` (default: only for a model of more
            than 1 GiB of tensors) writes the tensors to ``path + ".data"`` beside the file, which refers to it;
            without it every tensor is inline and nothing else is written.

    Raises:
        ValueError: nothing finalized, or annotated weights not finalized yet, or an initializer that
            is not N:M. RuntimeError: onnxruntime's output differs from PyTorch's beyond the dtype's tolerance.
    """
    onnx = _import("onnx")
    _import("onnxscript")
    from onnx import numpy_helper

    finalized = _finalized(model)

    packed = [name for name, param in model.named_parameters() if isinstance(param, PackedLinearWeight)]
    if packed:
        raise ValueError(
            f"export_onnx: {', '.join(packed[:3])}{' ...' if len(packed) > 3 else ''} are held packed only "
            "(nmcompile.deploy.pack_weights / load_packed) and ONNX has no 2:4 CPU kernel to run them; call "
            "nmcompile.deploy.unpack_weights(model) first: the file then stores them dense, verified 2:4"
        )
    args = _tensors(args)
    model.eval()
    with torch.no_grad():
        expected = model(*args)
    if dynamic_batch:
        batch = torch.export.Dim("batch")
        shapes = tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)
        export_kwargs.setdefault("dynamic_shapes", shapes)
    grids = {name: (bits, records.get(module, key, pname)) for name, places in owners(model)
             for _, module, pname in places[:1] for bits, key in ((8, records.INT8), (4, records.INT4))
             if name in finalized and records.get(module, key, pname) is not None}
    if opset is None and any(bits == 4 for bits, _ in grids.values()):
        opset = BLOCKED_OPSET
    if opset is not None:
        export_kwargs["opset_version"] = opset
    path = os.fspath(path)
    export_kwargs.setdefault("verbose", False)  # the exporter's step-by-step progress lines
    tensors = [*model.parameters(), *model.buffers()]
    external = export_kwargs.setdefault("external_data", sum(t.numel() * t.element_size() for t in tensors) > INLINE_BYTES)
    with _quiet_exporter():
        torch.onnx.export(model, args, path, dynamo=True, **export_kwargs)
    proto = onnx.load(path)
    params = dict(model.named_parameters())
    entries = {}
    for name, record in finalized.items():
        init_name, transposed = _find_initializer(proto, numpy_helper, name, params[name])
        if init_name is None:
            raise ValueError(
                f"export_onnx: no initializer of {path} holds the finalized weight {name!r} (the exporter folded it "
                "into another constant), so its N:M pattern cannot be verified"
            )
        axis = (1 - record.dim) if transposed else record.dim
        entries[init_name] = {"pattern": str(record.pattern), "axis": axis, "parameter": name, "recipe": record.recipe}
    quantize_initializers(proto, entries, grids)  # weights on recorded grids: their codes, dequantized
    del proto.metadata_props[:]
    proto.metadata_props.add(key=METADATA_KEY, value=json.dumps(entries, sort_keys=True))
    if external:  # the tensors go back to the one file beside the model that the model refers to
        onnx.save(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                  location=os.path.basename(path) + ".data")
    else:
        onnx.save(proto, path)
    result = OnnxExportReport(path, entries)
    result.check = check_onnx(path)
    if not result.check.ok:
        raise ValueError(f"export_onnx: the exported weights are not N:M:\n{result.check}")
    if verify:
        result.max_abs_diff = _compare_with_onnxruntime(path, args, expected, exact=bool(grids))
    return result


def _compare_with_onnxruntime(path: str, args, expected, exact: bool = False) -> float:
    """The largest difference of onnxruntime's CPU outputs from ``expected``. ``exact``: run the file as written
    (basic graph optimizations only): at its default level onnxruntime fuses a weight's DequantizeLinear and
    its MatMul into an int8 MatMul that rounds the activations to int8 too (measured: 0.6% of the logits' scale
    on a tiny Llama), which is onnxruntime's choice of kernel, not what the file computes."""
    ort = _import("onnxruntime")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    try:
        options = ort.SessionOptions()
        if exact:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), tensors)}
        outputs = session.run(None, feeds)
    except Exception as err:  # onnxruntime raises its own exception types
        dtypes = sorted({str(t.dtype) for t in tensors})
        raise RuntimeError(
            f"export_onnx: {path} was written and its N:M weights verified, but onnxruntime's CPU provider could "
            f"not run it to compare with PyTorch (inputs {', '.join(dtypes)}): {err}. It has no bfloat16 GEMM: "
            "export a float16/float32 copy to compare, or pass verify=False"
        ) from err
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    worst = 0.0
    for got, want in zip(outputs, expected):
        got_t = torch.from_numpy(got).to(want.dtype)
        atol, rtol = TOLERANCE.get(want.dtype, (1e-4, 1e-3))
        diff = (got_t.float() - want.float()).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        if not torch.allclose(got_t.float(), want.float(), atol=atol, rtol=rtol):
            raise RuntimeError(f"export_onnx: onnxruntime differs from PyTorch by up to {worst:.3g} (atol {atol}, rtol {rtol}) in {path}")
    return worst


def _recorded(path: str, meta: dict) -> dict | None:
    """The ``{initializer: {"pattern": "N:M", "axis": k, ...}}`` record :func:`export_onnx` wrote in
    the file's metadata, or None without one; ValueError naming what is wrong with a damaged one."""
    if METADATA_KEY not in meta:
        return None
    fix = (
        f"export the model again with nmcompile.export_onnx, or remove the metadata_props entry {METADATA_KEY!r} "
        "to check every initializer with --pattern and --dim"
    )
    try:
        recorded = json.loads(meta[METADATA_KEY])
    except ValueError as err:
        raise ValueError(
            f"{path}: nmcompile's record of the N:M initializers (metadata_props {METADATA_KEY!r}) is damaged: not "
            f"valid JSON ({err}); {fix}"
        ) from None
    if not isinstance(recorded, dict):
        raise ValueError(
            f"{path}: nmcompile's record {METADATA_KEY!r} is damaged: expected a JSON object of initializers, got "
            f"{type(recorded).__name__}; {fix}"
        )
    for name, entry in recorded.items():
        try:
            n, m = (int(v) for v in entry["pattern"].split(":"))
            NMPattern(n, m)
            int(entry["axis"])
        except (TypeError, KeyError, ValueError, AttributeError):
            raise ValueError(
                f"{path}: nmcompile's record {METADATA_KEY!r} is damaged at initializer {name!r}: expected "
                f'{{"pattern": "N:M", "axis": k}}, got {entry!r}; {fix}'
            ) from None
    return recorded


def check_onnx(path, pattern: NMPattern | None = None, *, dim: int = 1, only=None) -> CheckReport:
    """N:M compliance of an ONNX file's initializers.

    Initializers recorded by :func:`export_onnx` are checked with their recorded pattern and axis;
    without a record, every >= 2-D floating initializer is checked with ``pattern`` (default 2:4)
    along ``dim``. A recorded initializer is reported under the name of the parameter it holds (the
    exporter may name it ``val_8``); ``only``: glob pattern(s) of those names to check (default: all). A
    file that is not an ONNX model (empty, truncated, corrupt) or whose record is damaged raises
    ValueError; a model without such initializers gives a report that is not ok.
    """
    onnx = _import("onnx")
    from google.protobuf.message import DecodeError
    from onnx import numpy_helper

    try:
        proto = onnx.load(os.fspath(path))
    except DecodeError as err:
        raise ValueError(f"{os.fspath(path)}: not a readable ONNX model (truncated or corrupt? {err})") from None
    if not proto.HasField("graph"):
        raise ValueError(f"{os.fspath(path)}: not an ONNX model: it holds no graph (an empty or truncated file?)")
    meta = {p.key: p.value for p in proto.metadata_props}
    recorded = _recorded(os.fspath(path), meta)
    report = CheckReport()
    inits = {init.name: init for init in proto.graph.initializer}
    for init in proto.graph.initializer:
        # a tensor is named by the parameter it holds where the record says (the exporter may call it val_8)
        name = str((recorded or {}).get(init.name, {}).get("parameter") or init.name)
        if len(init.dims) < 2 or not selects(report, name, only):
            continue
        array = numpy_helper.to_array(init)
        entry = (recorded or {}).get(init.name)
        if entry is not None and entry.get("bits") in (8, 4):  # codes, dequantized in the graph
            n, m = (int(v) for v in entry["pattern"].split(":"))
            check_one(report, name, torch.from_numpy(codes_matrix(entry, array).astype("float32")),
                      pattern or NMPattern(n, m), int(entry["axis"]), codes_problem(entry, array, inits))
            continue
        if array.dtype.kind not in "fV" and array.dtype.name != "bfloat16":
            continue  # integer initializers (shapes, indices)
        tensor = torch.from_numpy(array.astype("float32"))  # numpy has no bfloat16; exact for N:M counts
        if recorded is not None:
            entry = recorded.get(init.name)
            if entry is None:
                report.skipped[name] = "not recorded as N:M by nmcompile (dense)"
                continue
            n, m = (int(v) for v in entry["pattern"].split(":"))
            check_one(report, name, tensor, pattern or NMPattern(n, m), int(entry["axis"]))
        else:
            check_one(report, name, tensor, pattern or NMPattern(2, 4), dim)
    return report
