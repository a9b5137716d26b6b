"""The questions about nmcompile's GPU path that only a GPU can answer, one gpu-marked test each
(``benchmarks/gpu/gpu_check.py`` runs them as its part 2 and tables their rows).

The CPU stand-in for the CUDA ops (tests/_gpu_contracts.py) proves that nmcompile's calls are ones
the ops accept and read as meant; these checks ask the GPU itself:

- ``alg_id``: one algorithm id, searched at 4096 tokens, reused at 8, 16, 64 and 200 tokens (the
  deploy op passes one id per layer to every call; cuSPARSELt's algorithm configs are per plan);
- ``sm90_shapes``: structured dims of 16, 48, 80 and dense dims of 8, 24, unpadded, through
  ``_cslt_compress`` and ``_cslt_sparse_mm`` (nmcompile allows multiples of 16 and 8, as PyTorch does);
- ``cuda_graph``: the deploy op and the compressing training GEMM captured in a CUDA graph and
  replayed (what ``mode="reduce-overhead"`` does; cuSPARSELt makes a plan and a workspace per call);
- ``step_gate``: STEP's gate is a 0-d tensor branched on in the training op (a host sync per layer
  per forward): the syncs one compiled step makes, and whether ``mode="reduce-overhead"`` trains;
- ``silent_pruning``: one training step of each recipe with cuSPARSELt against the reference kernel
  (which refuses an operand that is not 2:4, where cuSPARSELt would prune it silently);
- ``post_grad_passes``: a user's own post-grad pass next to nmcompile's cache-key pass (one
  chained pass: torch 2.11, on the GPU machines, calls the setting; only 2.13 takes a list);
- ``fp16``: cuSPARSELt in fp16 at the deploy test's shape, the product with algorithm 0 and with the
  searched one, each in a fresh process (an "illegal instruction"
  stopped the GPU there with cuSPARSELt 0.8.0 on sm90, and it poisons the process's CUDA context).

Each check returns rows ``{"check", "case", "status", "detail"}``; status is ``ok``, ``failed`` (with
the error or the mismatch) or ``skipped`` (with why). ``test_the_gpu_answers[<check>]`` fails on a
failed row; where ``GPU_CHECK_RISK_ROWS`` names a file, it appends its rows there as JSON lines (the
details gpu_check.py tables: the algorithm id found, the syncs counted, the errors measured). On a
CPU every check that needs CUDA says so; the others run there under the stand-in (the last test).
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile

STEP_RECIPE = "step:2:4,total_steps=4,t_max=0.5"
RECIPES = ("ste:2:4,wgrad=mvue24", "sr_ste:2:4", "s_ste:2:4,wgrad=mvue24", STEP_RECIPE, "mdgf:2:4",
           "sdgf:2:4,total_steps=4", "bi_mask:2:4,every=2,candidates=4", "transposable:2:4,wgrad=mvue24", "asp:2:4")


def row(check: str, case: str, status: str, detail: str = "") -> dict:
    return {"check": check, "case": case, "status": status, "detail": detail}


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _compare(out: torch.Tensor, expected: torch.Tensor, tol: float = 0.05) -> tuple[str, str]:
    err = (out.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item() + 1e-6
    return ("ok" if err <= tol * scale else "failed"), f"max error {err:.3g} (output scale {scale:.3g})"


def _pruned(rows: int, cols: int, device, dtype=torch.bfloat16) -> torch.Tensor:
    return nmcompile.masks.prune(torch.randn(rows, cols, device=device), 2, 4, 1).to(dtype)


def alg_id(device) -> list[dict]:
    from nmcompile.kernels.deploy_op import compress, sparse_linear

    w = _pruned(1024, 1024, device)
    values, meta = compress(w, "cusparselt")
    try:
        found = int(torch._cslt_sparse_mm_search(values, torch.randn(4096, 1024, device=device, dtype=w.dtype).t(),
                                                  transpose_result=True))
    except Exception as exc:
        return [row("alg_id", "search at 4096 tokens", "failed", _error(exc))]
    rows = [row("alg_id", "search at 4096 tokens", "ok", f"alg_id {found}")]
    for tokens in (8, 16, 64, 200):
        x = torch.randn(tokens, 1024, device=device, dtype=w.dtype)
        try:
            out = sparse_linear(x, w, values, meta, None, "cusparselt", found, 0)
            rows.append(row("alg_id", f"alg_id {found} at {tokens} tokens", *_compare(out, F.linear(x, w))))
        except Exception as exc:
            rows.append(row("alg_id", f"alg_id {found} at {tokens} tokens", "failed", _error(exc)))
    return rows


def sm90_shapes(device) -> list[dict]:
    rows = []
    for m in (16, 48, 80):
        for k in (16, 48, 80):
            a = _pruned(m, k, device)
            for n in (8, 24):
                b = torch.randn(k, n, device=device, dtype=a.dtype)
                case = f"[{m}, {k}] x [{k}, {n}]"
                try:
                    out = torch._cslt_sparse_mm(torch._cslt_compress(a), b)
                    rows.append(row("sm90_shapes", case, *_compare(out, a.float() @ b.float())))
                except Exception as exc:
                    rows.append(row("sm90_shapes", case, "failed", _error(exc)))
    return rows


def cuda_graph(device) -> list[dict]:
    if torch.device(device).type != "cuda":
        return [row("cuda_graph", "capture", "skipped", "needs CUDA")]
    from nmcompile.kernels.deploy_op import compress, sparse_linear
    from nmcompile.kernels.train_gemms import sparse24_mm

    w = _pruned(1024, 1024, device)
    values, meta = compress(w, "cusparselt")
    x = torch.randn(256, 1024, device=device, dtype=w.dtype)
    cases = {
        "deploy sparse_linear": lambda: sparse_linear(x, w, values, meta, None, "cusparselt", 0, 0),
        "training sparse24_mm (compress + mm)": lambda: sparse24_mm(w, x.t(), None, "cusparselt", True, "graph"),
    }
    rows = []
    for case, fn in cases.items():
        try:
            expected = fn()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # warm-up on the side stream, as CUDA-graph trees do
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            graph.replay()
            torch.cuda.synchronize()
            rows.append(row("cuda_graph", case, *_compare(out, expected)))
        except Exception as exc:
            rows.append(row("cuda_graph", case, "failed", _error(exc)))
    return rows


def _mlp(device, dtype=torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).to(device, dtype)


def _step(model, compiled, x) -> torch.Tensor:
    out = compiled(x)
    out.float().pow(2).mean().backward()
    return out.detach()


def step_gate(device) -> list[dict]:
    if torch.device(device).type != "cuda":
        return [row("step_gate", "syncs and reduce-overhead", "skipped", "needs CUDA")]
    rows = []
    x = torch.randn(8, 64, 256, device=device, dtype=torch.bfloat16)
    model = _mlp(device)
    nmcompile.annotate(model, STEP_RECIPE)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="nmsparse", options={"train_kernel": "cusparselt", "inner": "aot_eager"})
    _step(model, compiled, x)  # compiles
    previous = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(model, compiled, x)
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        rows.append(row("step_gate", "host syncs in one compiled step (2 layers)", "ok", f"{syncs} sync warnings"))
    except Exception as exc:
        rows.append(row("step_gate", "host syncs in one compiled step (2 layers)", "failed", _error(exc)))
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    model = _mlp(device)
    nmcompile.annotate(model, STEP_RECIPE)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="nmsparse", options={"mode": "reduce-overhead", "train_kernel": "cusparselt"})
        for _ in range(4):  # the gate switches within these steps
            out = _step(model, compiled, x)
            for p in model.parameters():
                p.grad = None
        ok = bool(torch.isfinite(out.float()).all())
        rows.append(row("step_gate", "STEP under mode='reduce-overhead'", "ok" if ok else "failed", "4 steps"))
    except Exception as exc:
        rows.append(row("step_gate", "STEP under mode='reduce-overhead'", "failed", _error(exc)))
    return rows


def silent_pruning(device, recipes=RECIPES, kernel: str = "cusparselt") -> list[dict]:
    rows = []
    x = torch.randn(4, 64, 256, device=device, dtype=torch.bfloat16)
    for recipe in recipes:
        results = {}
        try:
            for k in (kernel, "reference"):
                torch._dynamo.reset()
                model = _mlp(device)
                nmcompile.annotate(model, recipe)
                compiled = torch.compile(model, backend="nmsparse", options={"train_kernel": k, "inner": "aot_eager"})
                torch.manual_seed(1)
                out = _step(model, compiled, x)
                results[k] = (out, torch.cat([p.grad.float().flatten() for p in model.parameters()]))
        except Exception as exc:
            rows.append(row("silent_pruning", recipe, "failed", _error(exc)))
            continue
        (out, grads), (ref_out, ref_grads) = results[kernel], results["reference"]
        status, detail = _compare(out, ref_out)
        drift = ((grads - ref_grads).norm() / (ref_grads.norm() + 1e-6)).item()
        if drift > 0.05:
            status = "failed"
        rows.append(row("silent_pruning", recipe, status, f"output {detail}; gradient relative difference {drift:.3g}"))
    return rows


def post_grad_passes(device) -> list[dict]:
    from nmcompile.backends.inductor_cache import CacheKeyPass

    class Counting(CacheKeyPass):  # the user's pass: counts its calls
        calls = 0

        def __call__(self, graph) -> None:
            type(self).calls += 1

    model = _mlp(device)
    nmcompile.annotate(model, "ste:2:4")
    torch._dynamo.reset()
    case = f"user pass and nmcompile's, torch {torch.__version__}"
    try:  # without the compile caches, which would serve an earlier compile of this graph without its passes
        compiled = torch.compile(model, backend="nmsparse",
                                 options={"post_grad_custom_post_pass": Counting("user"), "train_kernel": "dense",
                                          "fx_graph_cache": False})
        with torch._functorch.config.patch(enable_autograd_cache=False):
            _step(model, compiled, torch.randn(4, 8, 256, device=device, dtype=torch.bfloat16))
    except Exception as exc:
        return [row("post_grad_passes", case, "failed", _error(exc))]
    status = "ok" if Counting.calls > 0 else "failed"
    return [row("post_grad_passes", case, status, f"the user's pass ran {Counting.calls} times")]


FP16_STEPS = """
import sys, torch
from nmcompile.masks import prune
step, rows, cols, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
w = prune(torch.randn(rows, cols, device="cuda"), 2, 4, 1).half()
x = torch.randn(tokens, cols, device="cuda").half()
values = torch._cslt_compress(w)
alg = 0
if step in ("search", "searched"):
    alg = int(torch._cslt_sparse_mm_search(values, x.t(), transpose_result=True))
if step != "compress" and step != "search":
    out = torch._cslt_sparse_mm(values, x.t(), transpose_result=True, alg_id=alg)
    err = (out.float() - torch.nn.functional.linear(x.float(), w.float())).abs().max().item()
    torch.cuda.synchronize()
    print(f"alg_id {alg}, max error {err:.3g}")
else:
    torch.cuda.synchronize()
    print(f"alg_id {alg}" if step == "search" else "compressed")
"""


def fp16(device) -> list[dict]:
    if torch.device(device).type != "cuda":
        return [row("fp16", "cuSPARSELt fp16 steps", "skipped", "needs CUDA")]
    root = str(Path(__file__).resolve().parents[2])
    rows = []
    for shape in ((4096, 1024, 4096),):  # the small shapes of the kernel tests ran in fp16
        for step in ("alg0", "searched"):
            case = f"{step} {shape[0]}x{shape[1]}, {shape[2]} tokens"
            try:
                done = subprocess.run([sys.executable, "-c", FP16_STEPS, step, *map(str, shape)], capture_output=True,
                                      text=True, timeout=60, cwd=root, env={**os.environ, "PYTHONPATH": root})
                lines = (done.stdout + done.stderr).strip().splitlines()
                error = [line for line in lines if "Error" in line]
                rows.append(row("fp16", case, "ok" if done.returncode == 0 else "failed",
                                (lines[-1] if done.returncode == 0 else (error or lines or [""])[-1])[:200]))
            except subprocess.TimeoutExpired:
                rows.append(row("fp16", case, "failed", "timed out after 60 s"))
    return rows


CHECKS = {"alg_id": alg_id, "sm90_shapes": sm90_shapes, "cuda_graph": cuda_graph, "step_gate": step_gate,
          "silent_pruning": silent_pruning, "post_grad_passes": post_grad_passes, "fp16": fp16}


def run_checks(device, left=lambda: float("inf"), needs: float = 20.0, only=None) -> list[dict]:
    """Every check in :data:`CHECKS` (or those named in ``only``), in order, while ``left()`` seconds
    remain (``needs`` per check); an exception is a failed row, and the next check runs."""
    unknown = set(only or ()) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown GPU risk checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    rows = []
    for name, check in CHECKS.items():
        if only is not None and name not in only:
            continue
        if left() < needs:
            rows.append(row(name, "all", "skipped", "time budget"))
            continue
        try:
            rows.extend(check(device))
        except Exception as exc:
            rows.append(row(name, "all", "failed", _error(exc)))
    return rows


# ---- the tests: on a GPU, one per check; on the CPU, the checks against the CUDA contracts


@pytest.mark.gpu
@pytest.mark.parametrize("check", list(CHECKS))
def test_the_gpu_answers(check):
    rows = run_checks("cuda", only=(check,))
    if os.environ.get("GPU_CHECK_RISK_ROWS"):
        with open(os.environ["GPU_CHECK_RISK_ROWS"], "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    failed = [r for r in rows if r["status"] != "ok"]
    assert not failed, "; ".join(f"{r['case']}: {r['status']}, {r['detail']}" for r in failed)


@pytest.mark.inductor
@pytest.mark.slow
def test_risk_checks_run_against_the_cuda_contracts_on_the_cpu():
    from _gpu_contracts import emulated_gpu

    with emulated_gpu() as emu:
        rows = alg_id("cpu") + sm90_shapes("cpu") + cuda_graph("cpu")
        rows += silent_pruning("cpu", recipes=("transposable:2:4,wgrad=mvue24",))
    by_check = {}
    for r in rows:
        by_check.setdefault(r["check"], []).append(r)
    assert [r["case"] for r in by_check["alg_id"]] == [
        "search at 4096 tokens", "alg_id 0 at 8 tokens", "alg_id 0 at 16 tokens", "alg_id 0 at 64 tokens",
        "alg_id 0 at 200 tokens"]
    assert len(by_check["sm90_shapes"]) == 18 and "[48, 80] x [80, 24]" in [r["case"] for r in by_check["sm90_shapes"]]
    assert all(r["status"] == "ok" for c in ("alg_id", "sm90_shapes", "silent_pruning") for r in by_check[c]), rows
    assert by_check["cuda_graph"] == [row("cuda_graph", "capture", "skipped", "needs CUDA")]
    assert {c.dims[2] for c in emu.calls if c.op == "cslt_sparse_mm_search"} == {4096}
    assert step_gate("cpu")[0]["status"] == "skipped"
    (passes,) = post_grad_passes("cpu")  # torch 2.13 takes the list; the GPU machines' 2.11 says
    assert passes["status"] == "ok" and "ran 2 times" in passes["detail"], passes  # forward and backward graphs
    # a wrong product is a failed row, not a pass
    assert _compare(torch.ones(4), torch.zeros(4))[0] == "failed"
    skipped = run_checks("cpu", left=lambda: 0.0)
    assert [r["check"] for r in skipped] == list(CHECKS) and {r["status"] for r in skipped} == {"skipped"}
