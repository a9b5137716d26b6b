"""Whole-model decode of 2:4 with int8 values against what a CPU user runs instead, in one process, interleaved.

A Llama-shaped Hugging Face directory (``--model``, default ``/work/models/llama-SHAPE``, made by
``make_models.py``) in bf16, run as:

- ``dense bf16`` and ``dense fp32``: the model as loaded (eager, and bf16 compiled by Inductor);
- ``torch int8``: every decoder linear and the output head as PyTorch's weight-only int8
  (``aten._weight_int8pack_mm``, one bf16 scale per output channel): what torchao's and gpt-fast's int8 routes
  reach on a CPU; the input embedding stays bf16;
- ``2:4 bf16``: the 2:4 model of ``real_scale.load_24`` (packed, the head dense bf16), compiled with
  ``backend="nmsparse"``;
- ``2:4+int8``: the same model after ``nmcompile.deploy.pack_weights(model, bits=8)``: int8 codes with a scale
  per row, the output head (and the embedding tied to it) dense int8 rows; compiled with ``nmsparse``;
- ``2:4+int8 a8``: that model with ``pack_weights(model, activations="int8")``: the same codes, each call's
  activations quantized to int8 in blocks of 32 and multiplied as integers;
- ``2:4+int4``: the 2:4 model after ``pack_weights(model, bits=4)`` (``--group`` 64: 4-bit codes with an fp16
  scale per row and 64 positions, on the int8-activation route; the head dense int8 rows);
- ``torch int4``: every decoder linear and the head as PyTorch's weight-only int4
  (``aten._weight_int4pack_mm_for_cpu``, a bf16 scale and zero per group of 128), torchao's CPU int4 kernel.

``--variants`` picks some of them (``--variants "2:4+int4" "torch int4" "dense bf16"``).

Each variant at 1 and 2 threads: greedy ``generate`` of ``--new-tokens`` (64) after a ``--prompt``-token (128)
random prompt, ``--runs`` rounds round-robin (medians of the decode step), prefill time and the weight bytes a
token reads (``real_scale.weight_bytes``), with the read bandwidth probed before and after.

    python benchmarks/models/int8_decode.py --shape 1b --out benchmarks/results/int8_decode_1b.json
    python benchmarks/models/int8_decode.py --shape 1b --new-tokens 16 --prompt 32 --runs 1   # a quick look
    python benchmarks/models/int8_decode.py --shape 1b --estimate   # and `nmcompile tune`'s estimate against it

Run it alone: every figure is as good as the machine is quiet.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.models.real_scale import (Variant, decoder_linears, default_dir, load_24, load_dense,  # noqa: E402
                                          prompt_ids, release, summary, time_group, weight_bytes)
from benchmarks.toolbox import bandwidth, machine, resident_mb  # noqa: E402


#: 2:4+int8 with ``activations="int8"``: each call's activations quantized in blocks of 32, integer products
A8 = "2:4+int8 a8"
#: 2:4 with 4-bit values (``pack_weights(bits=4)``), on that route
INT4 = "2:4+int4"


class TorchInt8Linear(nn.Module):
    """A linear layer on ``aten._weight_int8pack_mm``: int8 weight ``[out, in]``, one bf16 scale per output."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.out_features = linear.out_features

    def forward(self, x):
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight_int8, self.scales)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class TorchInt4Linear(nn.Module):
    """A linear layer on ``aten._weight_int4pack_mm_for_cpu``: 4-bit codes, a bf16 scale and zero per row and
    group of 128 inputs (asymmetric: the group's range in 15 steps)."""

    def __init__(self, linear: nn.Linear, group: int = 128):
        super().__init__()
        w = linear.weight.detach().float()
        out_f, in_f = w.shape
        grouped = w.reshape(out_f, in_f // group, group)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        q = torch.round((grouped - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
        self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # [in / group, out, 2]: w = (q - 8) * scale + zero, zero = lo + 8 * scale
        self.register_buffer("scales_zeros", torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous()
                             .to(linear.weight.dtype))
        self.group, self.bias, self.out_features = group, linear.bias, out_f

    def forward(self, x):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), self.weight_int4, self.group,
                                                       self.scales_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def torch_quantized(model: nn.Module, kind=TorchInt8Linear) -> nn.Module:
    """Every decoder linear and the output head replaced by ``kind`` (a benchmark's own copy)."""
    for name, linear in [*decoder_linears(model), ("lm_head", model.lm_head)]:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, kind(linear))
    release()
    return model


def quantized_bytes(model: nn.Module) -> dict:
    """:func:`weight_bytes` with the buffers of :class:`TorchInt8Linear` and :class:`TorchInt4Linear` counted as
    weights."""
    counts = weight_bytes(model)
    extra = sum(b.nbytes for m in model.modules() if isinstance(m, (TorchInt8Linear, TorchInt4Linear))
                for b in m.buffers())
    return {"resident": counts["resident"] + extra, "per_token": counts["per_token"] + extra}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--model")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-fp32", action="store_true", help="leave dense fp32 out (its decode is the slowest)")
    ap.add_argument("--estimate", action="store_true", help="also `nmcompile tune`'s estimate of a token's cost in "
                    "each format, timed after the decodes in this process, against the measured decode (target: 15%%)")
    ap.add_argument("--group", type=int, default=64, help="positions a 4-bit scale covers (64 or 128)")
    ap.add_argument("--variants", nargs="+", help="the variants to run (default: all)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import nmcompile.deploy

    path = args.model or default_dir(args.shape)
    torch._dynamo.config.recompile_limit = 64
    ids = prompt_ids(path, args.prompt)
    result = {"machine": machine(), "model": path, "new_tokens": args.new_tokens, "prompt": args.prompt,
              "bandwidth_gbps": [bandwidth()], "bytes": {}, "rss_mb": {"start": resident_mb()}}
    variants: list[Variant] = []

    def add(kind, model, modes, backend=None):
        eager = model.forward
        for mode in modes:
            for t in args.threads:
                if mode == "eager":
                    forward = eager
                elif backend:
                    forward = torch.compile(eager, backend=backend, options={"cpp.threads": t})
                else:
                    forward = torch.compile(eager, options={"cpp.threads": t})
                variants.append(Variant(kind, mode, t, model, forward))

    wanted = set(args.variants or [A8, INT4, "2:4 bf16", "2:4+int8", "dense bf16", "torch int8", "torch int4",
                                   *([] if args.no_fp32 else ["dense fp32"])])
    if "2:4 bf16" in wanted:
        sparse, result["build_24"] = load_24(path, torch.bfloat16)
        result["bytes"]["2:4 bf16"] = weight_bytes(sparse)
        add("2:4 bf16", sparse, ["compiled"], "nmsparse")
    if wanted & {"2:4+int8", A8}:
        sparse8, _ = load_24(path, torch.bfloat16)
        decisions = nmcompile.deploy.pack_weights(sparse8, bits=8)
        result["pack_int8"] = {"layers": len(decisions), "head": str(decisions.get("lm_head.weight", "kept"))}
        if "2:4+int8" in wanted:
            result["bytes"]["2:4+int8"] = weight_bytes(sparse8)
            add("2:4+int8", sparse8, ["compiled"], "nmsparse")
        if A8 in wanted:
            sparse8a = copy.deepcopy(sparse8) if "2:4+int8" in wanted else sparse8  # the same codes, int8 activations
            nmcompile.deploy.pack_weights(sparse8a, activations="int8")
            result["bytes"][A8] = weight_bytes(sparse8a)
            add(A8, sparse8a, ["compiled"], "nmsparse")
    if INT4 in wanted:
        sparse4, _ = load_24(path, torch.bfloat16)
        decisions = nmcompile.deploy.pack_weights(sparse4, bits=4, group=args.group)
        result["pack_int4"] = {"layers": len(decisions), "group": args.group,
                               "head": str(decisions.get("lm_head.weight", "kept"))}
        result["bytes"][INT4] = weight_bytes(sparse4)
        add(INT4, sparse4, ["compiled"], "nmsparse")
    if "dense bf16" in wanted:
        dense = load_dense(path, torch.bfloat16)
        result["bytes"]["dense bf16"] = weight_bytes(dense)
        add("dense bf16", dense, ["eager", "compiled"])
    for kind, linear in (("torch int8", TorchInt8Linear), ("torch int4", TorchInt4Linear)):
        if kind in wanted:
            q = torch_quantized(load_dense(path, torch.bfloat16), linear)
            result["bytes"][kind] = quantized_bytes(q)
            add(kind, q, ["eager"])
    if "dense fp32" in wanted:
        dense32 = load_dense(path, torch.float32)
        result["bytes"]["dense fp32"] = weight_bytes(dense32)
        add("dense fp32", dense32, ["eager"])
    result["rss_mb"]["all loaded"] = resident_mb()
    print(json.dumps(result["bytes"]), flush=True)
    time_group(variants, ids, args.new_tokens, args.runs, slow=1e9)
    result["bandwidth_gbps"].append(bandwidth())
    result["variants"] = {v.name: summary(v, args.new_tokens) for v in variants}
    outs = {v.name: v.first["tokens"] for v in variants}
    result["tokens_match_dense_bf16_eager"] = {k: o == outs.get(f"dense bf16 eager {args.threads[0]}t") for k, o in outs.items()}
    best = {}
    for kind in {v.kind for v in variants}:
        mine = {k: s for k, s in result["variants"].items() if s["kind"] == kind}
        best[kind] = max(mine, key=lambda k: mine[k]["decode_tok_s"])
    result["best"] = best
    tok_s = {kind: result["variants"][name]["decode_tok_s"] for kind, name in best.items()}
    dense_best = max((tok_s[k] for k in tok_s if k.startswith("dense")), default=float("nan"))
    result["ratios"] = {kind: {"vs_best_dense": tok_s[kind] / dense_best,
                               **{f"vs_{t.replace(' ', '_')}": tok_s[kind] / tok_s[t] for t in ("torch int8", "torch int4")
                                  if t in tok_s},
                               "weight_GBps": result["bytes"][kind]["per_token"] * tok_s[kind] / 1e9}
                        for kind in tok_s}
    if "dense bf16" in result["bytes"]:
        dense_bf16 = result["bytes"]["dense bf16"]["resident"]
        result["resident_vs_dense_bf16"] = {k: b["resident"] / dense_bf16 for k, b in result["bytes"].items()}
    for name, s in result["variants"].items():
        print(f"  {name:>24}: {s['decode_tok_s']:7.2f} tok/s decode, prefill {s['prefill_s']:.2f} s ({s['timed']})")
    print(json.dumps({k: result.get(k) for k in ("best", "ratios", "resident_vs_dense_bf16")}, indent=1), flush=True)
    if args.estimate:
        result["estimate"] = estimate_against(path, result["variants"], args.threads, args.prompt + args.new_tokens // 2)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


#: the measured variant each format of the estimate is checked against (its best mode at that thread count)
ESTIMATED = {"dense": "dense bf16", "2:4": "2:4 bf16", "2:4+int8": "2:4+int8", "torch int8": "torch int8", A8: A8}


def estimate_against(path: str, measured: dict, threads, context: int) -> dict:
    """``nmcompile tune``'s estimate of a decoded token (:func:`nmcompile.app.tune.token_costs`) at each thread count,
    against the best measured decode of each format: ``{threads: {format: {...}}}``, printed."""
    from nmcompile.app.tune import token_costs

    out = {}
    before = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            costs = token_costs(path, dtype=torch.bfloat16, context=context)
            rows = {}
            for c in costs:
                tok_s = max(s["decode_tok_s"] for s in measured.values()
                            if s["kind"] == ESTIMATED[c.format] and s["threads"] == t)
                rows[c.format] = {"estimated_tok_s": 1 / c.seconds, "measured_tok_s": tok_s,
                                  "estimate_over_measured": (1 / c.seconds) / tok_s,
                                  "linears_ms": c.linear_seconds * 1e3, "other_ms": c.other_seconds * 1e3}
                print(f"  estimate {t}t {c.format:>10}: {1 / c.seconds:6.2f} tok/s estimated, {tok_s:6.2f} measured "
                      f"({(1 / c.seconds) / tok_s:.2f}x)", flush=True)
            out[t] = rows
    finally:
        torch.set_num_threads(before)
    return out


if __name__ == "__main__":
    main()
