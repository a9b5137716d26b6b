"""Two questions for a lent GPU that decide the next step of nmcompile's CUDA path (one GPU, about a minute).

    python benchmarks/gpu_probe.py --out results/gpu_probe.json

``tile``: can ``torch._sparse_semi_structured_tile(w, "", use_cutlass=False)`` (one kernel that gives a
2:4 tensor compressed for cuSPARSELt in both orientations) replace the two ``torch._cslt_compress`` calls
the training op makes per transposable weight and step? For a weight under a transposable 2:4 mask, it
asks whether the kernel keeps exactly the mask (the compressed buffers equal ``_cslt_compress``'s, the
products equal the dense ones), and times both under CUDA graph replay. For an MVUE-pruned gradient
(2:4 along one dim only) it reports the share of non-zeros the kernel would drop. Its algorithm ``""``
ranks signed values and re-prunes a masked weight; ``gpu_tile.py`` asks the question in full (with
``"largest_abs_values_greedy"``, the values and metadata regions apart, both product orientations).

``deploy``: where the compiled deploy of one 2:4 linear spends its GPU time under
``mode="reduce-overhead"`` against the raw ``torch._cslt_sparse_mm`` call (CUDA kernels from the profiler).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS = [(11008, 4096), (4096, 11008), (4096, 1024), (1024, 4096), (3072, 768), (768, 3072)]


def graph_ms(fn) -> float:
    from nmcompile.kernels.dispatch import time_cuda

    return time_cuda(fn, reps=20, graphs=True)


def tile_rows() -> list[dict]:
    from nmcompile.masks import mvue
    from nmcompile.masks.transposable import transposable_mask

    rows = []
    for out_f, in_f in WEIGHTS:
        row = {"weight": [out_f, in_f]}
        torch.manual_seed(0)
        w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
        w = w * transposable_mask(w, 2, 4)
        try:
            packed, _, packed_t, _, _ = torch._sparse_semi_structured_tile(w, "", False)
        except Exception as error:  # noqa: BLE001 - the probe's answer
            row["error"] = f"{type(error).__name__}: {error}"[:400]
            rows.append(row)
            print(row, flush=True)
            continue
        ref, ref_t = torch._cslt_compress(w), torch._cslt_compress(w.t().contiguous())
        row["same_buffer"] = bool(packed.numel() == ref.numel() and torch.equal(packed.view(-1), ref.view(-1)))
        row["same_buffer_t"] = bool(packed_t.numel() == ref_t.numel() and torch.equal(packed_t.view(-1), ref_t.view(-1)))
        row["shapes"] = [list(packed.shape), list(ref.shape), list(packed_t.shape), list(ref_t.shape)]
        print(row, flush=True)
        if packed.numel() == ref.numel():
            packed, packed_t = packed.view(ref.shape), packed_t.view(ref_t.shape)
        x = torch.randn(256, in_f, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(256, out_f, device="cuda", dtype=torch.bfloat16)
        dense, dense_t = (w.float() @ x.float().t()), (w.float().t() @ y.float().t())
        try:
            got = torch._cslt_sparse_mm(packed, x.t()).float()
            got_t = torch._cslt_sparse_mm(packed_t, y.t()).float()
            row["product_err"] = float((got - dense).abs().max() / dense.abs().max())
            row["product_t_err"] = float((got_t - dense_t).abs().max() / dense_t.abs().max())
        except Exception as error:  # noqa: BLE001
            row["product_err"] = f"{type(error).__name__}: {error}"[:300]
        row["tile_ms"] = graph_ms(lambda: torch._sparse_semi_structured_tile(w, "", False))
        row["cslt_compress_both_ms"] = graph_ms(
            lambda: (torch._cslt_compress(w), torch._cslt_compress(w.t().contiguous()))
        )
        g = mvue(torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16), 2, 4, dim=1)
        try:
            bitmask = torch._sparse_semi_structured_tile(g, "", False)[4]
            kept = torch._sparse_semi_structured_apply_dense(g, bitmask)
            row["mvue_operand"] = {"nonzeros": int((g != 0).sum()), "kept": int((kept != 0).sum()),
                                   "kept_equal": bool(torch.equal(kept, g * (kept != 0)))}
        except Exception as error:  # noqa: BLE001
            row["mvue_operand"] = f"{type(error).__name__}: {error}"[:300]
        rows.append(row)
        print(row, flush=True)
    return rows


def kernel_table(fn, steps: int = 10) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total:
            rows.append((event.key[:90], round(total / 1e3 / steps, 4)))
    return sorted(rows, key=lambda r: -r[1])[:8]


def deploy_rows(tokens: int = 2048, in_f: int = 4096, out_f: int = 11008) -> dict:
    import nmcompile
    from nmcompile.masks import prune

    torch.manual_seed(0)
    base = nn.Linear(in_f, out_f).cuda()
    with torch.no_grad():
        base.weight.copy_(prune(base.weight, 2, 4, 1))
    dense = nn.Linear(in_f, out_f).cuda().to(torch.bfloat16)
    dense.load_state_dict({k: v.to(torch.bfloat16) for k, v in base.state_dict().items()})
    sparse = base
    nmcompile.annotate(sparse, "ste:2:4")
    nmcompile.finalize(sparse)
    sparse.eval().to(torch.bfloat16)
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16)
    out = {}
    with torch.no_grad():
        dense_g = torch.compile(dense, mode="reduce-overhead", dynamic=False)
        sparse_g = torch.compile(sparse, backend="nmsparse", dynamic=False, options={"mode": "reduce-overhead"})
        values = torch._cslt_compress(dense.weight)
        alg = int(torch._cslt_sparse_mm_search(values, x.t(), bias=dense.bias, transpose_result=True))
        fns = {
            "dense_graphs": lambda: dense_g(x),
            "nmsparse_graphs": lambda: sparse_g(x),
            "raw_cslt": lambda: torch._cslt_sparse_mm(values, x.t(), bias=dense.bias, transpose_result=True, alg_id=alg),
            "raw_dense": lambda: F.linear(x, dense.weight, dense.bias),
        }
        for name, fn in fns.items():
            try:
                out[name] = kernel_table(fn)
            except Exception as error:  # noqa: BLE001
                out[name] = f"{type(error).__name__}: {error}"[:400]
            print(name, out[name], flush=True)
        out["report"] = {k: str(v) for k, v in nmcompile.deploy_report(sparse).items()}
        out["raw_alg"] = alg
    return out


BAD_CALLS = {
    "unknown isa": "op(x, v, b, None, None, 16, -1, 'sse9')",
    "double input": "op(x.double(), v, b, None, None, 16, -1, 'emulated512')",
    "in_features": "op(torch.randn(2, 48), v, b, None, None, 16, -1, 'emulated512')",
    "out_features": "op(x, v, b, None, None, 17, -1, 'emulated512')",
    "bf16 isa on fp32": "op(x, v, b, None, None, 16, -1, 'emulated512_bf16')",
}
CPU24_SETUP = (
    "import sys, torch\nfrom nmcompile.kernels import cpu24\nfrom nmcompile.masks import prune\n"
    "assert cpu24.status().available, cpu24.status().reason\n"
    "w = prune(torch.randn(16, 32), 2, 4, 1)\np = __import__('nmcompile').pack(w)\nv, b = cpu24.cpu_layout(p.values, p.meta)\n"
    "x = torch.randn(2, 32)\nop = torch.ops.nmsparse.cpu24_linear\n"
    "try:\n    {call}\n    print('no error')\nexcept RuntimeError as e:\n    print('raised', str(e).splitlines()[0][:160])\n"
)


def cpu24_errors() -> dict:
    """Each refused call of the CPU kernel in its own process: exit status and message (one crashed on
    a GPU machine's host CPU under torch 2.11)."""
    import subprocess

    root = str(Path(__file__).resolve().parents[1])
    out = {}
    for name, call in BAD_CALLS.items():
        done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CPU24_SETUP.format(call=call)], cwd=root,
                              capture_output=True, text=True, timeout=120)
        out[name] = {"rc": done.returncode, "tail": (done.stdout + done.stderr).strip().splitlines()[-3:]}
        print(name, out[name], flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu_probe.json"))
    parser.add_argument("--parts", default="tile,deploy")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and args.parts != "cpu24":
        print("gpu_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "cudagraph_unsafe_tag": hasattr(torch.Tag, "cudagraph_unsafe")}
    parts = args.parts.split(",")
    for name, fn in (("tile", tile_rows), ("deploy", deploy_rows), ("cpu24", cpu24_errors)):
        if name in parts:
            try:
                result[name] = fn()
            except Exception as error:  # noqa: BLE001 - keep the other part's answer
                result[name] = f"{type(error).__name__}: {error}"[:600]
                print(name, result[name], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
