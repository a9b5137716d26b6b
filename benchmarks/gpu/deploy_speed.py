"""Deploy-time speed of 2:4 linears on a CUDA GPU: dense vs cuSPARSELt vs torch.sparse vs nmsparse.

Per linear shape (tokens x in -> out) and dtype, interleaved in one process (CUDA events, warm-up,
medians, see benchmarks/toolbox.py), all on the same 2:4 weight (groups of 4 along the input dim):

  dense     F.linear(x, w, b)
  cslt      torch._cslt_sparse_mm(torch._cslt_compress(w), x.t(), bias=b, transpose_result=True,
            alg_id=<torch._cslt_sparse_mm_search>)
  semi      F.linear(x, torch.sparse.to_sparse_semi_structured(w), b)
  nmsparse  one nn.Linear: nmcompile.annotate(m, "ste:2:4"), nmcompile.finalize(m), m.eval() in the
            dtype, torch.compile(m, backend="nmsparse"); nmcompile.deploy_report(m) says which kernel
            it chose per layer and why

Shapes: ViT-L MLP 13008x1024->4096 and 13008x4096->1024; LLM 4096->4096, 4096->11008 and
11008->4096 at 1, 16, 2048 and 8192 tokens. Then end to end: a GPT-2-medium-sized decoder
(24 layers, d=1024, 16 heads, MLP 4096, vocab 50257, random weights) with every attention and
MLP linear 2:4, prefill 8 x 1024 tokens and a decode-like step 1 x 1 (no KV cache: one token's
forward), torch.compile(inductor) dense vs nmsparse.

Weights are reused across calls, so small ones sit in L2 (H100: 50 MB); the large LLM weights do not.
Not run in CI. On a machine without CUDA it says so and exits 0.

    python benchmarks/gpu/deploy_speed.py                       # fp16 and bf16, every shape, end to end
    python benchmarks/gpu/deploy_speed.py --quick --dtype fp16  # three shapes, 4-layer decoder, fewer reps
    python benchmarks/gpu/deploy_speed.py --out results.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import cell, gpu_env, short_error, time_interleaved  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
VIT = [("vit-l fc1", 13008, 1024, 4096), ("vit-l fc2", 13008, 4096, 1024)]
LLM_IO = [(4096, 4096), (4096, 11008), (11008, 4096)]
LLM_TOKENS = (1, 16, 2048, 8192)
QUICK = [("vit-l fc1", 13008, 1024, 4096), ("llm", 16, 4096, 11008), ("llm", 2048, 4096, 11008)]
GPT2_MEDIUM = dict(layers=24, d=1024, heads=16, hidden=4096, vocab=50257, ctx=1024)


def shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    if quick:
        return QUICK
    return VIT + [("llm", t, i, o) for i, o in LLM_IO for t in LLM_TOKENS]


def pruned_24(out_features: int, in_features: int) -> torch.Tensor:
    """A random fp32 CUDA weight, 2:4 along the input dimension (dim 1)."""
    from nmcompile.masks import prune

    w = torch.randn(out_features, in_features, device="cuda") / in_features**0.5
    return prune(w, 2, 4, 1)


def kernel_choices(model: nn.Module) -> tuple[str, str]:
    """(short summary, full text) of nmcompile.deploy_report(model); the error text if it fails."""
    import nmcompile

    try:
        report = nmcompile.deploy_report(model)
    except Exception as exc:  # the report is informative; its absence must not stop the run
        return "n/a", f"deploy_report failed: {short_error(exc)}"
    kernels = [getattr(d, "kernel", str(d)) for d in report.values()]
    counts = {k: kernels.count(k) for k in dict.fromkeys(kernels)}
    summary = ", ".join(f"{k}" if len(kernels) == 1 else f"{k} x{n}" for k, n in counts.items()) or "none"
    full = "\n".join(f"    {fqn}: {getattr(d, 'kernel', d)} ({getattr(d, 'reason', '')})" for fqn, d in report.items())
    return summary, full


def nmsparse_model(model: nn.Module, dtype: torch.dtype, include=None) -> tuple[nn.Module, nn.Module]:
    """(finalized eager model, its torch.compile(backend="nmsparse")) from an fp32 CUDA model, in place."""
    import nmcompile

    nmcompile.annotate(model, "ste:2:4", include=include)
    nmcompile.finalize(model)
    model.eval().to(dtype)
    torch._dynamo.reset()  # fresh cache: each benchmark compiles one new model, never hits the recompile limit
    return model, torch.compile(model, backend="nmsparse", dynamic=False)


def graphs_variants(dense: nn.Module, sparse: nn.Module, fns: dict, errors: dict, x) -> None:
    """``dense_graphs`` and ``nmsparse_graphs``: both compiled with mode="reduce-overhead" (CUDA
    graphs: no host work per call, where cuSPARSELt plans at every call), added to ``fns``."""
    try:
        dense_graphs = torch.compile(dense, mode="reduce-overhead", dynamic=False)
        fns["dense_graphs"] = lambda: dense_graphs(x)
    except Exception as exc:
        errors["dense_graphs"] = short_error(exc)
    try:
        sparse_graphs = torch.compile(sparse, backend="nmsparse", dynamic=False, options={"mode": "reduce-overhead"})
        fns["nmsparse_graphs"] = lambda: sparse_graphs(x)
    except Exception as exc:
        errors["nmsparse_graphs"] = short_error(exc)


def linear_row(name: str, tokens: int, fin: int, fout: int, dtype: torch.dtype, reps: int, warmup: int,
               graphs: bool = False) -> dict:
    w32 = pruned_24(fout, fin)
    b32 = torch.randn(fout, device="cuda") * 0.01
    w, b = w32.to(dtype), b32.to(dtype)
    x = torch.randn(tokens, fin, device="cuda", dtype=dtype)
    fns, setup_errors = {"dense": lambda: F.linear(x, w, b)}, {}

    try:
        compressed = torch._cslt_compress(w)
        alg = torch._cslt_sparse_mm_search(compressed, x.t(), bias=b, transpose_result=True)
        fns["cslt"] = lambda: torch._cslt_sparse_mm(compressed, x.t(), bias=b, transpose_result=True, alg_id=alg)
    except Exception as exc:
        setup_errors["cslt"] = short_error(exc)
    try:
        w_semi = torch.sparse.to_sparse_semi_structured(w)
        fns["semi"] = lambda: F.linear(x, w_semi, b)
    except Exception as exc:
        setup_errors["semi"] = short_error(exc)
    model = None
    try:
        linear = nn.Linear(fin, fout, device="cuda")
        with torch.no_grad():
            linear.weight.copy_(w32)
            linear.bias.copy_(b32)
        dense_model = copy.deepcopy(nn.Sequential(linear)).eval().to(dtype)
        model, compiled = nmsparse_model(nn.Sequential(linear), dtype)
        fns["nmsparse"] = lambda: compiled(x)
        if graphs:
            graphs_variants(dense_model, model, fns, setup_errors, x)
    except Exception as exc:
        setup_errors["nmsparse"] = short_error(exc)

    times = {**setup_errors, **time_interleaved(fns, reps=reps, warmup=warmup)}
    kernel, report = kernel_choices(model) if model is not None else ("n/a", "")  # the last compile's decisions
    row = {"shape": f"{name} {tokens}x{fin}->{fout}", "dtype": str(dtype).removeprefix("torch."), **times}
    row["nmsparse_kernel"], row["nmsparse_report"] = kernel, report
    if isinstance(times.get("dense"), float) and isinstance(times.get("cslt"), float):
        out = torch._cslt_sparse_mm(compressed, x.t(), bias=b, transpose_result=True, alg_id=alg)
        row["cslt_max_abs_err"] = (out.float() - F.linear(x, w, b).float()).abs().max().item()
    return row


def print_linear_table(rows: list[dict]) -> None:
    print("\n| shape | dtype | dense ms | cslt ms | semi ms | nmsparse ms | dense, graphs ms | nmsparse, graphs ms | "
          "nmsparse kernel (graphs) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d, g = r.get("dense"), r.get("dense_graphs")
        cols = [cell(d), cell(r.get("cslt"), d), cell(r.get("semi"), d), cell(r.get("nmsparse"), d), cell(g),
                cell(r.get("nmsparse_graphs"), g)]
        print(f"| {r['shape']} | {r['dtype']} | " + " | ".join(cols) + f" | {r['nmsparse_kernel']} |")


# --- end to end: a GPT-2-medium-sized decoder, plain torch.nn ----------------------------------


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """GPT-2-style pre-norm decoder; logits for every position."""

    def __init__(self, layers: int, d: int, heads: int, hidden: int, vocab: int, ctx: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def prune_blocks_(model: Decoder) -> None:
    """Make every attention and MLP linear weight 2:4 (so dense and nmsparse compute the same function)."""
    from nmcompile.masks import prune

    with torch.no_grad():
        for module in model.blocks.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(prune(module.weight, 2, 4, 1))


def e2e_rows(dtype: torch.dtype, quick: bool, reps: int, warmup: int, graphs: bool = False) -> list[dict]:
    config = dict(GPT2_MEDIUM, layers=4 if quick else GPT2_MEDIUM["layers"])
    torch.manual_seed(0)
    base = Decoder(**config).cuda()
    prune_blocks_(base)
    sparse_eager = copy.deepcopy(base)
    dense = base.eval().to(dtype)
    cases = {"prefill 8x1024": (8, 1024), "decode-like 1x1": (1, 1)}
    rows = []
    nm_compiled, nm_error = None, None
    try:
        sparse_eager, nm_compiled = nmsparse_model(sparse_eager, dtype, include=["blocks.*"])
    except Exception as exc:
        nm_error = short_error(exc)
    for label, (batch, seq) in cases.items():
        ids = torch.randint(0, config["vocab"], (batch, seq), device="cuda")
        torch._dynamo.reset()
        dense_compiled = torch.compile(dense, backend="inductor", dynamic=False)
        fns, errors = {"dense": lambda: dense_compiled(ids)}, {}
        if nm_compiled is not None:
            fns["nmsparse"] = lambda: nm_compiled(ids)
            if graphs:
                graphs_variants(dense, sparse_eager, fns, errors, ids)
        times = {**errors, **time_interleaved(fns, reps=reps, warmup=warmup)}
        if nm_error is not None:
            times["nmsparse"] = nm_error
        kernel, report = kernel_choices(sparse_eager) if nm_compiled is not None else ("n/a", "")
        layers = f"{config['layers']} layers"
        rows.append({"case": f"{label} ({layers})", "dtype": str(dtype).removeprefix("torch."), **times,
                     "nmsparse_kernel": kernel, "nmsparse_report": report})
    return rows


def print_e2e_table(rows: list[dict]) -> None:
    print("\n| decoder | dtype | dense (inductor) ms | nmsparse ms | dense, graphs ms | nmsparse, graphs ms | nmsparse kernels |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        d, g = r.get("dense"), r.get("dense_graphs")
        print(f"| {r['case']} | {r['dtype']} | {cell(d)} | {cell(r.get('nmsparse'), d)} | {cell(g)} | "
              f"{cell(r.get('nmsparse_graphs'), g)} | {r['nmsparse_kernel']} |")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three shapes, a 4-layer decoder, 20 reps")
    parser.add_argument("--dtype", choices=["fp16", "bf16", "both"], default="both")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per variant (default 100, quick 20)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--skip-linear", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--reports", action="store_true", help="print nmsparse's per-layer kernel reasons")
    parser.add_argument("--graphs", action="store_true",
                        help="also dense and nmsparse under CUDA graphs (mode='reduce-overhead'), against each other")
    parser.add_argument("--out", default=None, help="write every measurement to this JSON file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("deploy_speed: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured")
        return 0
    reps = args.reps or (20 if args.quick else 100)
    dtypes = [DTYPES[k] for k in (("fp16", "bf16") if args.dtype == "both" else (args.dtype,))]
    env = gpu_env()
    print(" | ".join(f"{k}: {v}" for k, v in env.items()))
    print(f"reps {reps} (median), warm-up {args.warmup}, variants interleaved")
    linear, e2e = [], []
    if not args.skip_linear:
        for dtype in dtypes:
            for name, tokens, fin, fout in shapes(args.quick):
                row = linear_row(name, tokens, fin, fout, dtype, reps, args.warmup, graphs=args.graphs)
                linear.append(row)
                print(f"  {row['shape']} {row['dtype']}: " + ", ".join(
                    f"{k} {cell(row.get(k))}" for k in ("dense", "cslt", "semi", "nmsparse", "dense_graphs",
                                                        "nmsparse_graphs")), flush=True)
                if args.reports and row["nmsparse_report"]:
                    print(row["nmsparse_report"])
                torch.cuda.empty_cache()
        print_linear_table(linear)
    if not args.skip_e2e:
        try:
            e2e = e2e_rows(dtypes[0], args.quick, reps, args.warmup, graphs=args.graphs)
        except Exception as exc:  # e.g. out of memory: keep the linear results
            print(f"end to end failed: {short_error(exc)}")
        if e2e:
            print_e2e_table(e2e)
            if args.reports and e2e[0]["nmsparse_report"]:
                print(e2e[0]["nmsparse_report"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "reps": reps, "linear": linear, "e2e": e2e}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
