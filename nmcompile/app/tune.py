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


def tune(model_dir: str | Path, *, threads=None, dtypes=None, routes=tuple(ROUTES), tokens=None,
         include_heads: bool = False, progress=None) -> tuple[list[Tuned], dict[str, str]]:
    """Time and store the decisions of every distinct linear shape of the model in ``model_dir``.

    ``threads``: thread counts (default: torch's current); ``dtypes``: weight dtypes (default: the
    config's, fp32 where it names none); ``routes``: names from :data:`ROUTES`; ``tokens``: static
    token counts to time as well (a graph compiled for a fixed count times that count alone; the
    default is the dynamic ladder only). Returns the rows and the layers left out, with why."""
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
                            measured = measure_ladder(out_f, in_f, dtype, bias, isa, ladder, ROUTES[route])
                            max_tokens = max_tokens_of(measured)
                            stored = "stored" if measured.stored else f"not stored: {measured.not_stored}"
                            rows.append(Tuned(out_f, in_f, bias, dtype, int(count), route, len(names), max_tokens,
                                              measured.ratios, stored,
                                              unwritable=measured.source == "timed" and not measured.stored))
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
    if len(rows) - written - len(unwritable):
        summary += f"; {len(rows) - written - len(unwritable)} not stored: the bytes decided (timed again at deploy)"
    out.append(summary)
    out.append(f"measured on: {decision_cache.describe_cpu(decision_cache.cpu_identity())}, host {platform.node()} "
               "(the cache's key names this CPU: another microarchitecture or ISA set times anew)")
    if skipped:
        out.append(f"left out ({len(skipped)}): " + "; ".join(f"{name}: {why.split(';')[0]}"
                                                               for name, why in list(skipped.items())[:5])
                   + (" ..." if len(skipped) > 5 else ""))
    return "\n".join(out)
