"""``nmcompile tune DIR``: time the CPU deploy decisions for a model's linear shapes once, into the
decision cache, so that deploying processes (a server's every start) read them instead of timing.

The model is built from its ``config.json`` on the meta device (no weights read, no memory): each
distinct linear shape (out, in, bias) is timed once per dtype, thread count and deploy route, on
random 2:4 weights of that shape, exactly as a compile would time it
(:func:`nmcompile.kernels.dispatch.cpu.measure_ladder`). Output heads and MoE routers, which a
declaration keeps dense by default, are left out unless asked for. Run it on a quiet machine: a
timing that cannot be right is not stored, and the table says so.
"""

from __future__ import annotations

import numbers
import os
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from ..declare.defaults import default_reason
from ..kernels import cpu24
from ..kernels.dispatch import RATIO_BASELINE, format_ratios
from ..kernels.dispatch import cache as decision_cache
from ..kernels.dispatch.cpu import CPU_LADDER, max_tokens_of, measure_ladder

__all__ = ["linear_shapes", "tune", "format_table", "Tuned", "ROUTES"]

#: deploy routes: a finalized model through torch.compile (the dense weight stays resident), and
#: pack_weights (the weight held packed only: above the range, it is unpacked for the call)
ROUTES = {"compile": False, "pack_weights": True}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Tuned:
    out_features: int
    in_features: int
    bias: bool
    dtype: torch.dtype
    threads: int
    route: str
    layers: int  # how many of the model's layers have this shape
    max_tokens: int
    ratios: tuple  # ((tokens, dense / sparse time), ...)
    stored: str  # "stored", or "not stored: why"
    unwritable: bool = False  # timed and trusted, but the cache folder could not be written


def _config_dtype(config) -> torch.dtype:
    value = getattr(config, "dtype", None) or config.__dict__.get("torch_dtype")
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def linear_shapes(model_dir: str | Path, include_heads: bool = False):
    """``({(out, in, bias): [layer names]}, skipped, config dtype)`` of a Hugging Face model directory's
    linear layers (``nn.Linear`` and GPT-2's ``Conv1D``), built on the meta device from its config."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} has no config.json; pass a Hugging Face model directory (the one "
                         "from_pretrained reads)")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.pytorch_utils import Conv1D
    except ImportError as err:
        raise ImportError(f"nmcompile tune reads the model's config with transformers, which is not installed "
                          f"({err}); pip install transformers") from err

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes: dict[tuple[int, int, bool], list[str]] = {}
    skipped: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out_f, in_f = module.weight.shape
        elif isinstance(module, Conv1D):  # weight [in, out]
            in_f, out_f = module.weight.shape
        else:
            continue
        why = None if include_heads else default_reason(f"{name}.weight", (out_f, in_f))
        if why is None and in_f % 16:
            why = f"in_features {in_f} is not a multiple of 16 (the 2:4 CPU kernel's word)"
        if why is not None:
            skipped[name] = why
            continue
        shapes.setdefault((int(out_f), int(in_f), module.bias is not None), []).append(name)
    return shapes, skipped, _config_dtype(config)


def machine_busy() -> str | None:
    """Why timings taken now would measure other work (the last minute's load average above this process's
    cores), or None."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system: nothing to say
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if load <= cores:
        return None
    return (f"the machine is busy (load average {load:.1f} over the last minute on {cores} cores): timings now "
            "would measure the other work; run tune again when it is quiet, or pass --even-if-busy")


def tune(model_dir: str | Path, *, threads=None, dtypes=None, routes=tuple(ROUTES), tokens=None,
         include_heads: bool = False, progress=None, even_if_busy: bool = False) -> tuple[list[Tuned], dict[str, str]]:
    """Time and store the decisions of every distinct linear shape of the model in ``model_dir``.

    ``threads``: thread counts (default: torch's current); ``dtypes``: weight dtypes (default: the
    config's, fp32 where it names none); ``routes``: names from :data:`ROUTES`; ``tokens``: static
    token counts to time as well (a graph compiled for a fixed count times that count alone; the
    default is the dynamic ladder only). On a busy machine (:func:`machine_busy`) it warns, times and keeps
    nothing, unless ``even_if_busy``. Returns the rows and the layers left out, with why."""
    for name, counts in (("tokens", tokens), ("threads", threads)):  # before any work
        for count in counts or ():
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
                raise ValueError(f"{name}: {count!r} is not a positive integer; {name} counts are 1 or more")
    if not decision_cache.enabled():
        raise ValueError(f"the decision cache is off ({decision_cache.SWITCH_ENV}="
                         f"{os.environ[decision_cache.SWITCH_ENV]}): tune would time and keep nothing; "
                         "unset it")
    state = cpu24.status()
    if not state.available:
        raise RuntimeError(f"nothing to tune: the 2:4 CPU kernel is not available here ({state.reason})")
    unknown = [r for r in routes if r not in ROUTES]
    if unknown:
        raise ValueError(f"unknown route(s) {unknown}; accepted: {', '.join(ROUTES)}")
    shapes, skipped, config_dtype = linear_shapes(model_dir, include_heads)
    dtypes = list(dtypes or [config_dtype])
    ladders = [CPU_LADDER] + [(int(t),) for t in tokens or ()]
    busy = None if even_if_busy else machine_busy()
    if busy:
        warnings.warn(f"nmcompile tune: {busy}", RuntimeWarning, stacklevel=2)
    before = torch.get_num_threads()
    rows = []
    try:
        for count in threads or [before]:
            torch.set_num_threads(int(count))
            for dtype in dtypes:
                isa = cpu24.best_isa(dtype)
                for (out_f, in_f, bias), names in shapes.items():
                    for route in routes:
                        for ladder in ladders:
                            if progress:
                                progress(f"[{out_f}, {in_f}] {str(dtype).replace('torch.', '')} {count} thread(s) "
                                         f"{route} tokens {ladder[0]}{'...' if len(ladder) > 1 else ''}")
                            measured = measure_ladder(out_f, in_f, dtype, bias, isa, ladder, ROUTES[route],
                                                      keep_out=busy)
                            max_tokens = max_tokens_of(measured)
                            stored = "stored" if measured.stored else f"not stored: {measured.not_stored}"
                            rows.append(Tuned(out_f, in_f, bias, dtype, int(count), route, len(names), max_tokens,
                                              measured.ratios, stored,
                                              unwritable=measured.source == "timed" and not measured.stored
                                              and not busy))
    finally:
        torch.set_num_threads(before)
    return rows, skipped


def format_table(rows: list[Tuned], skipped: dict[str, str]) -> str:
    head = ("shape [out, in]", "bias", "dtype", "threads", "route", "layers", "sparse for tokens", RATIO_BASELINE,
            "cache")
    lines = []
    for r in rows:
        span = "none" if r.max_tokens == 0 else f"{r.ratios[0][0]} to {r.max_tokens}"
        lines.append((f"[{r.out_features}, {r.in_features}]", "yes" if r.bias else "no",
                      str(r.dtype).replace("torch.", ""), str(r.threads), r.route, str(r.layers), span,
                      format_ratios(r.ratios), r.stored))
    widths = [max(len(str(c)) for c in column) for column in zip(head, *lines)]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *lines)]
    written = sum(r.stored == "stored" for r in rows)
    summary = f"decision cache: {decision_cache.cache_root() / 'cpu24'}: {written} of {len(rows)} decisions written"
    unwritable = [r for r in rows if r.unwritable]
    if unwritable:
        summary += f"; {len(unwritable)} not stored: {unwritable[0].stored.removeprefix('not stored: ')}"
    busy = [r for r in rows if r.stored.startswith("not stored: the machine is busy")]
    if busy:
        summary += f"; {len(busy)} not stored: the machine was busy"
    if len(rows) - written - len(unwritable) - len(busy):
        summary += (f"; {len(rows) - written - len(unwritable) - len(busy)} not stored: the bytes decided (timed again "
                    "at deploy)")
    out.append(summary)
    out.append(f"measured on: {decision_cache.describe_cpu(decision_cache.cpu_identity())}, host {platform.node()} "
               "(the cache's key names this CPU: another microarchitecture or ISA set times anew)")
    if skipped:
        out.append(f"left out ({len(skipped)}): " + "; ".join(f"{name}: {why.split(';')[0]}"
                                                               for name, why in list(skipped.items())[:5])
                   + (" ..." if len(skipped) > 5 else ""))
    return "\n".join(out)


# What a decoded token would cost in each format, before anything is pruned: each distinct linear shape's
# kernels timed at one token (weights rotated past the caches, formats interleaved), times how many layers
# have that shape, plus the other bytes a token reads at the bandwidth the dense kernels reached.

#: the formats a token's cost is estimated for: what the decoder's linears and the output head run as
FORMATS = {"dense": ("dense", "dense"), "2:4": ("2:4", "dense"), "2:4+int8": ("2:4+int8", "int8 rows"),
           "2:4+int8 a8": ("2:4+int8 a8", "int8 rows a8"), "torch int8": ("torch int8", "torch int8")}
#: the formats whose int8 weights take their activations as int8 (``pack_weights(activations="int8")``): AVX2 only
A8_FORMATS = ("2:4+int8 a8",)
#: weight bytes per timed variant: copies rotated so that a call never finds its weight in the caches
COLD_BYTES = 256 << 20
MAX_COPIES = 64


@dataclass(frozen=True)
class TokenCost:
    format: str
    linear_seconds: float  # the decoder's linears and the head, one token
    weight_bytes: int  # what they read
    other_seconds: float  # norms, the embedding row, the KV cache at ``context``, at the dense kernels' bandwidth

    @property
    def seconds(self) -> float:
        return self.linear_seconds + self.other_seconds


def _weights(out_f: int, in_f: int, dtype: torch.dtype, head: bool) -> dict[str, tuple]:
    """``{variant: tensors}`` of one random weight ``[out_f, in_f]`` (2:4 by magnitude unless ``head``) in each
    variant's format."""
    from ..kernels.cpu24.quantize import quantize_dense, quantize_layout, row_scales
    from ..kernels.cpu24.weight import PackedLinearWeight
    from ..masks.topn import prune

    w = torch.randn(out_f, in_f).to(dtype)
    if not head:
        w = prune(w, 2, 4, 1)
    scales = row_scales(w)
    codes = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    out = {"dense": (w,), "torch int8": (codes, scales.to(dtype))}
    isa8 = cpu24.best_isa(torch.int8) or "avx2"
    if head:  # a layer kept dense: int8 rows where the kernel takes it, else as it was
        if in_f % 16:
            out["int8 rows"] = out["dense"]
        else:
            values, s = quantize_dense(w)
            out["int8 rows"] = (PackedLinearWeight(values, None, (out_f, in_f), -1, isa8, False, s, dtype),)
        if "avx2" in cpu24.isas():
            out["int8 rows a8"] = (out["int8 rows"][0]._with(isa=cpu24.A8_ISA),) if in_f % 16 == 0 else out["dense"]
        return out
    values, bits, _ = cpu24.cpu_pack(w)
    q_values, q_s = quantize_layout(values, out_f)
    out["2:4"] = (PackedLinearWeight(values, bits, (out_f, in_f), -1, cpu24.best_isa(dtype) or ""),)
    out["2:4+int8"] = (PackedLinearWeight(q_values, bits, (out_f, in_f), -1, isa8, False, q_s, dtype),)
    if "avx2" in cpu24.isas():
        out["2:4+int8 a8"] = (out["2:4+int8"][0]._with(isa=cpu24.A8_ISA),)
    return out


def _call(variant: str, x: torch.Tensor, tensors: tuple) -> torch.Tensor:
    if variant == "torch int8":
        return torch.ops.aten._weight_int8pack_mm(x, *tensors)
    return torch.nn.functional.linear(x, tensors[0])


def _bytes(tensors: tuple) -> int:
    return sum(t.nbytes_packed if hasattr(t, "nbytes_packed") else t.numel() * t.element_size() for t in tensors)


def _time_shape(out_f: int, in_f: int, dtype: torch.dtype, head: bool, rounds: int) -> dict[str, tuple[float, int]]:
    """``{variant: (median seconds of one call at one token, weight bytes)}``: each variant's copies called in turn
    (so that no call finds its weight in the caches), the variants interleaved in each round."""
    import copy
    import statistics
    import time

    first = _weights(out_f, in_f, dtype, head)
    copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // max(1, _bytes(first["dense"])))))
    sets = [first] + [copy.deepcopy(first) for _ in range(copies - 1)]
    x = torch.randn(1, in_f).to(dtype)
    samples: dict[str, list[float]] = {name: [] for name in first}
    with torch.no_grad():
        for weights in sets[:2]:  # warm-up: first calls
            for name, tensors in weights.items():
                _call(name, x, tensors)
        for _ in range(rounds):
            for name in samples:
                start = time.perf_counter()
                for weights in sets:
                    _call(name, x, weights[name])
                samples[name].append((time.perf_counter() - start) / copies)
    return {name: (statistics.median(t), _bytes(first[name])) for name, t in samples.items()}


def token_costs(model_dir: str | Path, *, dtype: torch.dtype | None = None, context: int = 160, rounds: int = 7,
                progress=None) -> list[TokenCost]:
    """What one decoded token would cost the model in ``model_dir`` in each of :data:`FORMATS`, at torch's current
    thread count: its linear shapes' kernels timed here at one token (the layers a declaration keeps dense, the
    output head and MoE routers, as the format holds its head: dense, int8 rows or torch int8), plus the other
    bytes a token reads (the non-linear parameters, one embedding row, the KV cache at ``context`` positions) at
    the bandwidth the dense kernels reached. Python's and the framework's per-call work is not in it."""
    if not cpu24.status().available:
        raise RuntimeError(f"no estimate: the 2:4 CPU kernel is not available here ({cpu24.status().reason})")
    sparse, _, config_dtype = linear_shapes(model_dir)
    every, _, _ = linear_shapes(model_dir, include_heads=True)
    dtype = dtype or config_dtype
    formats = [f for f in FORMATS if f not in A8_FORMATS or "avx2" in cpu24.isas()]
    seconds = {f: 0.0 for f in formats}
    nbytes = {f: 0 for f in formats}
    for (out_f, in_f, bias), names in every.items():
        dense_names = [n for n in names if n not in sparse.get((out_f, in_f, bias), ())]
        for head, count in ((False, len(names) - len(dense_names)), (True, len(dense_names))):
            if not count:
                continue
            if progress:
                progress(f"[{out_f}, {in_f}] x {count}{' (kept dense)' if head else ''}: one token in each format")
            timed = _time_shape(out_f, in_f, dtype, head, rounds)
            for fmt in formats:
                linear, kept = FORMATS[fmt]
                t, b = timed[kept if head else linear]
                seconds[fmt] += count * t
                nbytes[fmt] += count * b
    bandwidth = nbytes["dense"] / seconds["dense"] if seconds["dense"] else 0.0
    other = _other_bytes(model_dir, dtype, context)
    return [TokenCost(f, seconds[f], nbytes[f], other / bandwidth if bandwidth else 0.0) for f in formats]


def _other_bytes(model_dir: str | Path, dtype: torch.dtype, context: int) -> int:
    """The bytes a token reads besides the linear weights: the other parameters (norms; of an embedding, one row)
    and the KV cache at ``context`` positions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                total += p.shape[1] * size
            elif p.dim() < 2:
                total += p.numel() * size
    text = getattr(config, "text_config", None) or config
    layers = getattr(text, "num_hidden_layers", 0) or 0
    heads = getattr(text, "num_attention_heads", 1) or 1
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (getattr(text, "hidden_size", 0) or 0) // heads
    return total + 2 * layers * kv * head_dim * context * size


def format_costs(costs: list[TokenCost], threads: int) -> str:
    base = next(c for c in costs if c.format == "dense").seconds
    head = ("format", "linears + head ms", "other ms", "ms/token", "tokens/s", "weight MB read", "vs dense")
    lines = [(c.format, f"{c.linear_seconds * 1e3:.2f}", f"{c.other_seconds * 1e3:.2f}", f"{c.seconds * 1e3:.2f}",
              f"{1 / c.seconds:.2f}", f"{c.weight_bytes / 1e6:.1f}", f"{base / c.seconds:.2f}x") for c in costs]
    widths = [max(len(str(v)) for v in column) for column in zip(head, *lines)]
    out = [f"what a decoded token would cost, estimated from this machine's kernels at {threads} thread(s) (Python's "
           "and the framework's per-call work not counted):"]
    out += ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in (head, *lines)]
    return "\n".join(out)
