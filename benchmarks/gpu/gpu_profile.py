"""Where the time of nmcompile's GPU 2:4 path goes: host overhead or GPU kernels (one GPU, a few minutes).

    python benchmarks/gpu/gpu_profile.py --out benchmarks/results/gpu_profile.json

For each GEMM shape (tokens x in -> out, bf16): ``F.linear`` against ``torch._cslt_sparse_mm`` (its
algorithm searched at that shape) and nmcompile's ``nmsparse::sparse_linear`` op, each timed three ways:

- ``eager``: 50 calls issued back to back, CUDA events around all of them (what a Python loop or an
  Inductor graph without CUDA graphs gets; bound by the host where the host is slower than the GPU);
- ``host``: the host's wall time per call while issuing them (no synchronisation inside the loop);
- ``graph``: 10 calls captured in one CUDA graph, median of 10 replays (GPU time alone, what
  ``mode="reduce-overhead"`` gets; the deploy and training decisions time this way under it;
  ``benchmarks.toolbox.graph_ms``); where capture fails, the eager time, and ``..._graph_timed`` says why.

Then ``torch._cslt_compress`` per weight (the training path compresses each step), and a profile of
one MLP block's training step (``torch.compile`` dense against ``backend="nmsparse"`` with
``transposable:2:4,wgrad=mvue24``), its top CUDA kernels by time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import RESULTS, gpu_env, graph_ms  # noqa: E402

SHAPES = [(16, 4096, 11008), (2048, 4096, 11008), (8192, 4096, 4096), (13008, 1024, 4096),
          (8192, 768, 3072), (8192, 3072, 768), (12608, 4096, 1024)]


def eager_ms(fn, calls: int = 50) -> tuple[float, float]:
    """(GPU ms per call issued back to back, host ms per call to issue them)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / calls
    end.synchronize()
    return start.elapsed_time(end) / calls, host


def gemm_rows() -> list[dict]:
    from nmcompile.kernels.deploy_op import sparse_linear
    from nmcompile.masks import prune

    rows = []
    for tokens, fin, fout in SHAPES:
        torch.manual_seed(0)
        w = prune(torch.randn(fout, fin, device="cuda"), 2, 4, 1).to(torch.bfloat16)
        b = torch.randn(fout, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(tokens, fin, device="cuda", dtype=torch.bfloat16)
        values = torch._cslt_compress(w)
        alg = int(torch._cslt_sparse_mm_search(values, x.t(), bias=b, transpose_result=True))
        empty = values.new_empty(0, dtype=torch.int16)
        fns = {
            "dense": lambda: F.linear(x, w, b),
            "cslt": lambda: torch._cslt_sparse_mm(values, x.t(), bias=b, transpose_result=True, alg_id=alg),
            "nmsparse_op": lambda: sparse_linear(x, w, values, empty, b, "cusparselt", alg, 0),
        }
        row = {"shape": f"{tokens}x{fin}->{fout}", "alg_id": alg}
        with torch.inference_mode():
            for name, fn in fns.items():
                try:
                    row[f"{name}_eager"], row[f"{name}_host"] = eager_ms(fn)
                    row[f"{name}_graph"], how = graph_ms(fn, reps=40)
                    if how != "graph":
                        row[f"{name}_graph_timed"] = how
                except Exception as exc:  # recorded, the other variants still run
                    row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        flops = 2 * tokens * fin * fout
        row["dense_graph_tflops"] = round(flops / row.get("dense_graph", float("nan")) / 1e9, 1)
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        torch.cuda.empty_cache()
    return rows


def compress_rows() -> list[dict]:
    rows = []
    for fout, fin in ((4096, 1024), (1024, 4096), (3072, 768), (11008, 4096)):
        w = torch.randn(fout, fin, device="cuda", dtype=torch.bfloat16)
        row = {"weight": f"{fout}x{fin}"}
        try:
            row["compress_eager"], row["compress_host"] = eager_ms(lambda: torch._cslt_compress(w))
            row["compress_graph"], how = graph_ms(lambda: torch._cslt_compress(w), reps=40)
            if how != "graph":
                row["compress_graph_timed"] = how
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def step_profile(recipe: str | None, kernel: str, d: int = 1024, tokens: int = 12608, top: int = 14) -> dict:
    import nmcompile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)).cuda().to(torch.bfloat16)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    if recipe is None:
        compiled = torch.compile(model, dynamic=False)
    else:
        nmcompile.annotate(model, recipe)
        compiled = torch.compile(model, backend="nmsparse", dynamic=False, options={"train_kernel": kernel})

    def step():
        for p in model.parameters():
            p.grad = None
        compiled(x).backward(dy)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    wall = eager_ms(step, calls=10)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)
    kernels = [{"name": e.key[:90], "calls": e.count // 5, "ms_per_step": round(getattr(e, "self_device_time_total", 0) / 5e3, 4)}
               for e in events[:top]]
    gpu_total = sum(getattr(e, "self_device_time_total", 0) for e in events) / 5e3
    out = {"variant": recipe or "dense", "kernel": kernel, "step_ms": round(wall[0], 4), "host_ms": round(wall[1], 4),
           "gpu_busy_ms": round(gpu_total, 4), "top_kernels": kernels}
    print(json.dumps(out, indent=1), flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "gpu_profile.json"))
    parser.add_argument("--skip-steps", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA GPU here; nothing measured")
        return 0
    result = gpu_env()
    result["gemm"] = gemm_rows()
    result["compress"] = compress_rows()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if not args.skip_steps:
        result["steps"] = []
        for recipe, kernel in ((None, "-"), ("transposable:2:4,wgrad=mvue24", "dense"),
                               ("transposable:2:4,wgrad=mvue24", "cusparselt"), ("ste:2:4", "cusparselt")):
            try:
                result["steps"].append(step_profile(recipe, kernel))
            except Exception as exc:
                result["steps"].append({"variant": recipe, "kernel": kernel, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
