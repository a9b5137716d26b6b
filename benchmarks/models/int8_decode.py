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
  activations quantized to int8 in blocks of 32 and multiplied as integers.

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


def torch_int8(model: nn.Module) -> nn.Module:
    """Every decoder linear and the output head replaced by :class:`TorchInt8Linear` (a benchmark's own copy)."""
    for name, linear in [*decoder_linears(model), ("lm_head", model.lm_head)]:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, TorchInt8Linear(linear))
    release()
    return model


def int8_bytes(model: nn.Module) -> dict:
    """:func:`weight_bytes` with the int8 buffers of :class:`TorchInt8Linear` counted as weights."""
    counts = weight_bytes(model)
    extra = sum(b.nbytes for m in model.modules() if isinstance(m, TorchInt8Linear) for b in m.buffers())
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

    sparse, build = load_24(path, torch.bfloat16)
    result["build_24"] = build
    result["bytes"]["2:4 bf16"] = weight_bytes(sparse)
    add("2:4 bf16", sparse, ["compiled"], "nmsparse")
    sparse8, _ = load_24(path, torch.bfloat16)
    decisions = nmcompile.deploy.pack_weights(sparse8, bits=8)
    result["pack_int8"] = {"layers": len(decisions), "head": str(decisions.get("lm_head.weight", "kept"))}
    result["bytes"]["2:4+int8"] = weight_bytes(sparse8)
    add("2:4+int8", sparse8, ["compiled"], "nmsparse")
    sparse8a = copy.deepcopy(sparse8)  # the same codes, on the route that quantizes the activations
    nmcompile.deploy.pack_weights(sparse8a, activations="int8")
    result["bytes"][A8] = weight_bytes(sparse8a)
    add(A8, sparse8a, ["compiled"], "nmsparse")
    dense = load_dense(path, torch.bfloat16)
    result["bytes"]["dense bf16"] = weight_bytes(dense)
    add("dense bf16", dense, ["eager", "compiled"])
    q8 = torch_int8(load_dense(path, torch.bfloat16))
    result["bytes"]["torch int8"] = int8_bytes(q8)
    add("torch int8", q8, ["eager"])
    if not args.no_fp32:
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
    dense_best = max(tok_s[k] for k in tok_s if k.startswith("dense"))
    result["ratios"] = {kind: {"vs_best_dense": tok_s[kind] / dense_best, "vs_torch_int8": tok_s[kind] / tok_s["torch int8"],
                               "weight_GBps": result["bytes"][kind]["per_token"] * tok_s[kind] / 1e9}
                        for kind in tok_s}
    dense_bf16 = result["bytes"]["dense bf16"]["resident"]
    result["resident_vs_dense_bf16"] = {k: b["resident"] / dense_bf16 for k, b in result["bytes"].items()}
    for name, s in result["variants"].items():
        print(f"  {name:>24}: {s['decode_tok_s']:7.2f} tok/s decode, prefill {s['prefill_s']:.2f} s ({s['timed']})")
    print(json.dumps({k: result[k] for k in ("best", "ratios", "resident_vs_dense_bf16")}, indent=1), flush=True)
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
