"""TensorRT deploy routes for a finalized nmcompile model (2:4 weights baked in, dense, zero-filled).

After :func:`nmcompile.finalize`, every sparse layer is a plain module whose weight holds zeros in
2 of every 4 entries along its input (reduction) dimension, which is the layout TensorRT checks
when its ``SPARSE_WEIGHTS`` builder flag is set. TensorRT inspects *constant* weights, picks a
sparse tactic only where it times faster than the dense one, and says what it did in its build log.

Routes:

- :func:`compile_aot`: ``torch.export`` (batch dimension dynamic) then
  ``torch_tensorrt.dynamo.compile(..., sparse_weights=True)``. Returns the compiled module and a
  :class:`SparsityLog` parsed from the builder log captured during the build.
- :func:`onnx_session`: an ONNX file (exported from the finalized model with dense zero-filled
  initializers) run by onnxruntime's TensorRT execution provider with ``trt_sparsity_enable``.
  ``trtexec --onnx=model.onnx --sparsity=enable --fp16 --verbose`` is the command-line equivalent;
  :func:`parse_sparsity_log` reads its output too.

Not a route: ``torch.compile(model, backend="tensorrt")``. Dynamo lifts parameters to graph
inputs, and the TensorRT engine then receives the weights as runtime inputs, not constants, so
the builder never sees 2:4 weights and picks no sparse tactic. nmcompile therefore deploys to
TensorRT ahead of time, through ``torch.export``.

Versions: torch-tensorrt's minor version must equal torch's (torch-tensorrt 2.11 needs torch 2.11
and TensorRT 10.15.1 on CUDA 13.0; 2.13 needs torch 2.13 and TensorRT 11.0). Install with
``pip install "nmcompile[tensorrt]"`` (or ``pip install "torch-tensorrt==<torch major.minor>.*"``).
From torch-tensorrt 2.13 on there is no ``enabled_precisions``: the engine's precision follows the
model's dtype, so cast the model (``model.half()``) before compiling. The ONNX route needs
``onnxruntime-gpu`` built with the TensorRT execution provider and TensorRT's libraries on the
library path.

No TensorRT, torch-tensorrt or onnxruntime import happens at import of this module.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["SparsityLog", "parse_sparsity_log", "compile_aot", "onnx_session"]

_INSTALL_TRT = 'pip install "nmcompile[tensorrt]"'

# --- builder log -------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ELIGIBLE = re.compile(r"layers eligible for sparse math\s*:(.*)$", re.IGNORECASE)
_PICKED = re.compile(r"picked sparse implementation for layers?\s*:(.*)$", re.IGNORECASE)
_EMPTY_NAMES = {"", "none", "(none)", "n/a", "-"}


@dataclass(frozen=True)
class SparsityLog:
    """What TensorRT's builder said about 2:4 sparsity.

    ``eligible``: layers whose constant weights are 2:4 (TensorRT may run them sparse).
    ``picked``: layers the built engine runs with a sparse tactic.
    """

    eligible: tuple[str, ...] = ()
    picked: tuple[str, ...] = ()

    @property
    def dense_eligible(self) -> tuple[str, ...]:
        """Eligible layers for which TensorRT timed a dense tactic faster and kept it."""
        chosen = set(self.picked)
        return tuple(name for name in self.eligible if name not in chosen)

    def __str__(self) -> str:
        if not self.eligible and not self.picked:
            return (
                "TensorRT sparsity: no layer eligible for sparse math (weights must be 2:4 along the "
                "input dimension, fp16/bf16/int8/fp8, and the builder log must have been captured)"
            )
        names = list(self.eligible) + [n for n in self.picked if n not in self.eligible]
        width = max(len("layer"), *(len(n) for n in names))
        chosen = set(self.picked)
        lines = [
            f"TensorRT sparsity: {len(self.picked)} of {len(self.eligible)} eligible layers run sparse",
            f"{'layer':<{width}}  kernel",
            f"{'-' * width}  ------",
        ]
        for name in names:
            kernel = "sparse" if name in chosen else "dense (eligible, dense was faster)"
            if name not in self.eligible:
                kernel = "sparse (not listed as eligible)"
            lines.append(f"{name:<{width}}  {kernel}")
        return "\n".join(lines)


def _names(text: str) -> list[str]:
    return [n for n in (part.strip() for part in text.split(",")) if n.lower() not in _EMPTY_NAMES]


def _unique(names: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def parse_sparsity_log(text: str) -> SparsityLog:
    """Parse the ``(Sparsity)`` lines of a TensorRT builder log (TensorRT, trtexec or torch-tensorrt).

    Reads ``Layers eligible for sparse math: a, b`` and ``TRT inference plan picked sparse
    implementation for layers: a`` anywhere on a line, whatever prefix (timestamps, ``[TRT]``,
    ``[V]``/``[I]``, Python logging) comes before. Several such lines accumulate; a list ending
    with a comma continues on the next line; ``None`` or nothing after the colon means no layer.
    Names keep the order of their first mention and appear once.
    """
    eligible: list[str] = []
    picked: list[str] = []
    target: list[str] | None = None  # the list a trailing comma continues into
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).strip()
        match_e, match_p = _ELIGIBLE.search(line), _PICKED.search(line)
        if match_e or match_p:
            target = eligible if match_e else picked
            rest = (match_e or match_p).group(1)
        elif target is not None:
            rest = line
        else:
            continue
        target.extend(_names(rest))
        if not rest.rstrip().endswith(","):
            target = None
    return SparsityLog(eligible=_unique(eligible), picked=_unique(picked))


# Python loggers TensorRT's builder messages reach through torch-tensorrt: its trt.ILogger
# forwards to "torch_tensorrt [TensorRT Conversion Context]" (VERBOSE as DEBUG); the package's
# own loggers sit under "torch_tensorrt".
_TRT_LOGGERS = ("torch_tensorrt [TensorRT Conversion Context]", "torch_tensorrt")


class _SparsityLines(logging.Handler):
    """Keeps sparsity messages; passes on the rest at or above the level the logger had before."""

    def __init__(self, lines: list[str], threshold: int):
        super().__init__(logging.DEBUG)
        self.lines = lines
        self.threshold = threshold

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record from someone else's logger is not our failure
            return
        if "sparse" in message.lower() or "sparsity" in message.lower():
            self.lines.append(message)
        if record.levelno >= self.threshold:
            logging.getLogger().callHandlers(record)


@contextlib.contextmanager
def _captured_builder_log(torch_tensorrt):
    """Collect TensorRT's verbose builder messages about sparsity while the block runs.

    The loggers are lowered to DEBUG and stop propagating for the duration, so verbose records
    reach the user's handlers only if the user had asked for that level.
    """
    lines: list[str] = []
    loggers = [logging.getLogger(name) for name in _TRT_LOGGERS]
    thresholds = [logger.getEffectiveLevel() for logger in loggers]  # before debug() lowers them
    debug = getattr(getattr(torch_tensorrt, "logging", None), "debug", None)
    with contextlib.ExitStack() as stack:
        if debug is not None:
            stack.enter_context(debug())
        saved = []
        for logger, threshold in zip(loggers, thresholds):
            handler = _SparsityLines(lines, threshold)
            saved.append((logger, handler, logger.level, logger.propagate))
            logger.addHandler(handler)
            logger.setLevel(logging.DEBUG)
            logger.propagate = False
        try:
            yield lines
        finally:
            for logger, handler, level, propagate in saved:
                logger.removeHandler(handler)
                logger.setLevel(level)
                logger.propagate = propagate


# --- torch.export -> torch_tensorrt.dynamo.compile ---------------------------------------------


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def _import_torch_tensorrt():
    try:
        import torch_tensorrt
    except (ImportError, OSError) as exc:
        raise ImportError(
            f"nmcompile's TensorRT route needs torch-tensorrt: {_INSTALL_TRT}, or "
            f'pip install "torch-tensorrt=={".".join(_minor(torch.__version__))}.*" (its minor version '
            f"must equal torch's, {torch.__version__}); it also needs a CUDA GPU and TensorRT. "
            f"Import failed with: {exc}"
        ) from exc
    version = getattr(torch_tensorrt, "__version__", "")
    if version and _minor(version) != _minor(torch.__version__):
        raise ImportError(
            f"torch-tensorrt {version} does not match torch {torch.__version__}: their minor versions "
            f'must be equal. pip install "torch-tensorrt=={".".join(_minor(torch.__version__))}.*"'
        )
    return torch_tensorrt


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)


def _check_deployable(model: nn.Module, example_inputs: tuple) -> set[torch.dtype]:
    """Raise where TensorRT cannot build ``model``; warn where it builds but runs no sparse tactic.

    Returns the dtypes of the model's floating-point parameters.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_aot takes an nn.Module, got {type(model).__name__}")
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    off = [name for name, t in tensors if t.device.type != "cuda"]
    if off:
        raise ValueError(
            f"TensorRT builds on a CUDA GPU, but {len(off)} parameters/buffers are not on CUDA "
            f"(first: {off[0]} on {dict(tensors)[off[0]].device}); move the model with model.cuda()"
        )
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"example_inputs[{i}] is a {type(x).__name__}; compile_aot takes tensors only")
        if x.device.type != "cuda":
            raise ValueError(f"example_inputs[{i}] is on {x.device}; move it with .cuda()")
    dtypes = {p.dtype for _, p in model.named_parameters() if p.is_floating_point()}
    if torch.float32 in dtypes:
        warnings.warn(
            "the model has float32 weights: TensorRT's only sparse tactics for them run as TF32 and "
            "are often not picked; cast with model.half() (or .bfloat16()) and cast the inputs too",
            stacklevel=3,
        )
    return dtypes


def _batch_sizes(example_inputs: tuple, max_batch: int | None) -> tuple[int, int]:
    sizes = {x.shape[0] if x.dim() else None for x in example_inputs}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            "dynamic_batch=True needs every example input to share dimension 0 (the batch); got shapes "
            f"{[tuple(x.shape) for x in example_inputs]}. Pass dynamic_batch=False for fixed shapes"
        )
    batch = sizes.pop()
    top = batch if max_batch is None else int(max_batch)
    if top < batch:
        raise ValueError(f"max_batch={top} is below the example batch size {batch}; raise max_batch")
    return batch, top


def _export(model: nn.Module, example_inputs: tuple, batch: int, top: int, dynamic: bool):
    if not dynamic:
        return torch.export.export(model, example_inputs)
    if batch == 1:  # torch.export specializes a size-1 example; trace with two rows instead
        example_inputs = tuple(torch.cat([x, x]) for x in example_inputs)
    dim = torch.export.Dim("batch", min=1, max=top)
    return torch.export.export(model, example_inputs, dynamic_shapes=tuple({0: dim} for _ in example_inputs))


def _trt_inputs(torch_tensorrt, example_inputs: tuple, top: int, dynamic: bool) -> list:
    if not dynamic:
        return list(example_inputs)
    return [
        torch_tensorrt.Input(
            min_shape=(1, *x.shape[1:]),
            opt_shape=tuple(x.shape),
            max_shape=(top, *x.shape[1:]),
            dtype=x.dtype,
        )
        for x in example_inputs
    ]


def _compile_kwargs(compile_fn, dtypes: set, workspace_size, trt_kwargs: dict) -> dict:
    params = inspect.signature(compile_fn).parameters
    has_precisions = "enabled_precisions" in params
    if "enabled_precisions" in trt_kwargs and not has_precisions:
        raise ValueError(
            "this torch-tensorrt has no enabled_precisions: the engine's precision follows the model's "
            "dtype. Drop enabled_precisions and cast the model instead (model.half() or model.bfloat16())"
        )
    kwargs: dict = {"sparse_weights": True}
    if has_precisions and dtypes:
        kwargs["enabled_precisions"] = set(dtypes)
    if workspace_size is not None:
        kwargs["workspace_size"] = int(workspace_size)
    kwargs.update(trt_kwargs)
    return kwargs


def compile_aot(
    model: nn.Module,
    example_inputs,
    *,
    dynamic_batch: bool = True,
    max_batch: int | None = None,
    workspace_size: int | None = None,
    **trt_kwargs,
):
    """Build a TensorRT engine for a finalized model with sparse tactics enabled.

    ``model`` should be in eval mode, on CUDA, in the dtype to deploy (fp16/bf16: TensorRT's
    sparse tensor-core tactics do not cover fp32 weights beyond TF32, which it rarely picks).
    ``example_inputs`` is a tensor or a tuple of CUDA tensors. With ``dynamic_batch`` dimension 0
    of every input is dynamic from 1 to ``max_batch`` (default: the example's batch size, which is
    also TensorRT's optimization point). ``workspace_size`` (bytes) and ``trt_kwargs`` go to
    ``torch_tensorrt.dynamo.compile``; ``enabled_precisions`` is set from the model's dtype only on
    torch-tensorrt versions that still have it.

    Returns ``(compiled_module, SparsityLog)``. The log lists the layers TensorRT found 2:4 and the
    ones it runs sparse; an empty log comes with a warning saying what to check.
    """
    torch_tensorrt = _import_torch_tensorrt()
    example_inputs = _as_tuple(example_inputs)
    dtypes = _check_deployable(model, example_inputs)
    batch, top = _batch_sizes(example_inputs, max_batch) if dynamic_batch else (0, 0)
    dynamic = dynamic_batch and top > 1
    exported = _export(model, example_inputs, batch, top, dynamic)
    inputs = _trt_inputs(torch_tensorrt, example_inputs, top, dynamic)
    kwargs = _compile_kwargs(torch_tensorrt.dynamo.compile, dtypes, workspace_size, trt_kwargs)
    with _captured_builder_log(torch_tensorrt) as lines:
        compiled = torch_tensorrt.dynamo.compile(exported, inputs=inputs, **kwargs)
    log = parse_sparsity_log("\n".join(lines))
    if kwargs.get("sparse_weights") and not log.eligible:
        warnings.warn(
            "TensorRT reported no layer eligible for sparse math: check that the model was finalized "
            "(nmcompile.finalize) so its weights are 2:4 along the input dimension, that it is fp16/bf16, "
            "and that the layers are large enough to matter (TensorRT skips small GEMMs)",
            stacklevel=2,
        )
    return compiled, log


# --- ONNX -> onnxruntime TensorRT execution provider -------------------------------------------


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(
            "nmcompile's ONNX-to-TensorRT route needs onnxruntime with the TensorRT execution provider: "
            f"pip install onnxruntime-gpu (plus TensorRT's libraries). Import failed with: {exc}"
        ) from exc
    return onnxruntime


def onnx_session(path, *, fp16: bool = True, cache_dir=None, verbose_log: bool | None = None):
    """An ``onnxruntime.InferenceSession`` running ``path`` on TensorRT with sparsity enabled.

    The ONNX file should hold the finalized model's weights dense and zero-filled (plain ``Gemm``
    or ``MatMul`` initializers), which TensorRT checks for 2:4 itself. ``fp16`` lets TensorRT run
    fp32 layers in fp16, where its sparse tactics live. ``cache_dir`` keeps built engines there so
    later sessions skip the build. ``verbose_log=True`` sets the session's log severity to verbose,
    so TensorRT's detailed build log, ``(Sparsity)`` lines included, goes to onnxruntime's log on
    stderr (parse it with :func:`parse_sparsity_log`). Falls back to CUDA then CPU for nodes
    TensorRT does not take.
    """
    ort = _import_onnxruntime()
    available = ort.get_available_providers()
    if "TensorrtExecutionProvider" not in available:
        raise RuntimeError(
            "onnxruntime has no TensorrtExecutionProvider here (available: "
            f"{', '.join(available)}). Install onnxruntime-gpu (not onnxruntime) built with TensorRT, "
            "put TensorRT's libraries on the library path, and run on a CUDA GPU"
        )
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no ONNX file at {path!r}; export the finalized model first")
    trt_options: dict = {
        "trt_sparsity_enable": True,
        "trt_fp16_enable": bool(fp16),
        "trt_engine_cache_enable": bool(cache_dir),
        "trt_detailed_build_log": True,
    }
    if cache_dir:
        cache_dir = os.fspath(cache_dir)
        os.makedirs(cache_dir, exist_ok=True)
        trt_options["trt_engine_cache_path"] = cache_dir
    options = ort.SessionOptions()
    if verbose_log:
        options.log_severity_level = 0
    providers = [("TensorrtExecutionProvider", trt_options), "CUDAExecutionProvider", "CPUExecutionProvider"]
    return ort.InferenceSession(path, sess_options=options, providers=providers)
